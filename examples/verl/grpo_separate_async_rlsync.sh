#!/usr/bin/env bash
# verl GRPO with the trainer and the rollout on separate GPUs (trainer.v1.trainer_mode=separate_async), weights
# synced by rlsync. Install: pip install 'rlsync[verl]' (uv pip install ... resolves it in seconds; see the README).
# Everything but the three lines marked "rlsync" is an ordinary verl run; adjust model, data and sizes to yours.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
    trainer.v1.trainer_mode=separate_async \
    actor_rollout_ref.rollout.checkpoint_engine.backend=rlsync `# rlsync: the one flag` \
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.transport=nixl `# rlsync: across machines (shm on one)` \
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.verify=true `# rlsync: optional checksums per tensor` \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15 "$@"
