"""transformers (and plain torch) models: ``ModuleReceiver`` lands weights in place in an ``nn.Module``'s parameters
(``rlsync.adapters.hf._receiver`` says how); ``replay_routes`` makes a transformers MoE model's training forward
take the experts the generator took (``rlsync.adapters.hf._routes``); ``HeldReplay`` keeps one open from a forward
through its backward; ``token_rows`` and ``routes_at_rows`` lay records found by a forward's tokens out for it."""

from rlsync.adapters.hf._receiver import ModuleReceiver, module_layout
from rlsync.adapters.hf._routes import (
           HeldReplay,
           RouteLog,
           replay_routes,
           routers,
           routes_at_rows,
           routes_of,
           token_rows,
)

__all__ = ["HeldReplay", "ModuleReceiver", "RouteLog", "module_layout", "replay_routes", "routers", "routes_at_rows",
           "routes_of", "token_rows"]
