"""Host side: backend choice, settings, the world (process group + symmetric heap), errors, the launcher."""
from .backend import BACKEND, INTERPRET
from .errors import WaitTimeout, check_errors, unwrap_wait_timeouts
from .heap import SymmetricHeap
from .world import World, finalize, get, init, is_initialized

if INTERPRET:
    unwrap_wait_timeouts()
