"""launcher: lmlaunch's login side, by concept (docs/architecture.md). The root holds the entry
(``cli``) and the injectable command environment (``context``); everything else lives in the
package of its concept, each ``__init__`` saying what belongs there and what it may import:
``commands`` (thin adapters), ``spec``, ``runs``, ``planning``, ``submit``, ``monitor``,
``serve``, ``doctor``, ``search``, ``remote``, ``localcluster``. The shared kernel is ``lmcore``;
the runtime on the allocation is ``lmtrain``, which never imports this package.

Nothing here imports torch at import time: the CLI stays fast.
"""
