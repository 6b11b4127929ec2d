"""transformers (and plain torch) models: ``ModuleReceiver`` lands weights in place in an ``nn.Module``'s parameters
(``rlsync.adapters.hf._receiver`` says how); ``replay_routes`` makes a transformers MoE model's training forward
take the experts the generator took (``rlsync.adapters.hf._routes``); ``HeldReplay`` keeps one open from a forward
through its backward."""

from rlsync.adapters.hf._receiver import ModuleReceiver, module_layout
from rlsync.adapters.hf._routes import HeldReplay, RouteLog, replay_routes, routers, routes_of

__all__ = ["HeldReplay", "ModuleReceiver", "RouteLog", "module_layout", "replay_routes", "routers", "routes_of"]
