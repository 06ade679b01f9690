"""Host side: backend choice, the world (process group + symmetric heap), the launcher."""
from .backend import BACKEND, INTERPRET
from .heap import SymmetricHeap
from .world import World, finalize, get, init, is_initialized
