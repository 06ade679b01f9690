"""Measured tunables as data: the crossovers and launch settings that kernels choose by measurement.

Each value lives in a JSON table of one GPU model and world size, with the run that measured it:

    {"gpu": "H200", "world_size": 2,
     "values": {"all_gather.push_program_bytes": {"value": 16384,
                                                  "measured": {"command": "...", "date": "...", "commit": "..."},
                                                  "note": "..."}, ...}}

Shipped tables are `weft/tuning/data/<GPU>-x<W>.json`; `weft tune` writes local ones of the same form into
`$WEFT_TUNING_DIR` (default `~/.cache/weft/tuning/`). A key's family is its first dotted part, and each family
is read from one table, chosen by `table_for`: the tables holding the family, ranked by GPU model (the same,
else the same architecture, else any), then nearest world size (for the families in `PER_GPU`, whose values
do not depend on it, only to break ties), then local before shipped, then the larger world size. So a local
table of this GPU and world size wins; else the shipped one of the nearest world size; else the nearest known
GPU. The cpu backend has no tables of its own unless `weft tune` wrote one: it reads the nearest GPU's, and the
kernels keep their interpreter-sized settings in code where they have them.

Kernel modules call `value(key, device, world_size)` when they build a plan (plans are cached), never per call.
A missing key, a malformed file or a value of the wrong kind raises `TuningError` naming the file and key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent / "data"

# Families whose values depend on the GPU alone (local ops): world size only breaks ties between tables.
PER_GPU = frozenset({"gemm", "flash_decode", "grouped_gemm", "decode"})

# GPU models by architecture, for "the nearest known GPU model".
ARCHITECTURES = {"H100": "sm_90", "H200": "sm_90", "H800": "sm_90", "H20": "sm_90", "GH200": "sm_90",
                 "A100": "sm_80", "A800": "sm_80", "B200": "sm_100", "GB200": "sm_100"}


class TuningError(ValueError):
    """A tuning table that cannot be used: missing, malformed, or holding a value of the wrong kind."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v) -> bool:
    return _is_int(v) and v >= 0


def _limit(v) -> bool:  # bytes or rows from which something happens; null: never
    return v is None or _count(v)


def _number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and v >= 0


def _flag(v) -> bool:
    return isinstance(v, bool)


def _settings(v) -> bool:  # a launch setting or GEMM config: {field: int or bool}
    return isinstance(v, dict) and bool(v) and all(isinstance(k, str) and (_is_int(x) or _flag(x))
                                                  for k, x in v.items())


def _named_settings(v) -> bool:
    return isinstance(v, dict) and bool(v) and all(isinstance(k, str) and _settings(x) for k, x in v.items())


def _tuned_shapes(v) -> bool:  # [[m, n, k, config name], ...]
    return isinstance(v, list) and all(isinstance(e, list) and len(e) == 4 and all(map(_count, e[:3]))
                                       and isinstance(e[3], str) for e in v)


def _row_configs(v) -> bool:  # [[largest m or null, config], ...], the last row's m null
    return (isinstance(v, list) and bool(v) and v[-1][0] is None
            and all(isinstance(e, list) and len(e) == 2 and _limit(e[0]) and _settings(e[1]) for e in v))


def _per_size(v) -> bool:  # {size: count}: read by `by_size`
    return isinstance(v, dict) and bool(v) and all(isinstance(k, str) and k.isdigit() and int(k) > 0 and _count(x)
                                                  for k, x in v.items())


def _name(v) -> bool:
    return isinstance(v, str) and bool(v)


def _flags(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _flag(x) for k, x in v.items())


# Every key a table of the family must hold, with its kind (the check of its value) and a description.
KINDS = {_count: "a non-negative integer", _limit: "a non-negative integer or null (never)",
         _number: "a non-negative number", _flag: "true or false", _settings: "an object of integer settings",
         _named_settings: "an object of named settings objects", _tuned_shapes: "a list of [m, n, k, config name]",
         _row_configs: "a list of [largest m or null, config], the last with null", _name: "a name",
         _flags: "an object of true/false", _per_size: "an object of {size: non-negative integer}"}
KEYS = {
    "all_gather.push_program_bytes": _count,
    "all_gather.push_max_programs": _count,
    "all_gather.pull_program_bytes": _count,
    "all_gather.nccl_above.plain": _limit,
    "all_gather.nccl_above.none": _limit,
    "all_gather.nccl_above.symmetric": _limit,
    "all_reduce.one_shot_max_bytes": _count,
    "all_reduce.ll_max_bytes": _count,
    "all_reduce.ll_two_shot_max_bytes": _count,
    "all_reduce.ll_two_shot_symmetric_max_bytes": _count,
    "all_reduce.launch": _settings,
    "all_reduce.launch_large": _settings,
    "all_reduce.ll_launch": _settings,
    "all_reduce.nccl_above.in_place": _limit,
    "all_reduce.nccl_above.plain": _limit,
    "all_reduce.nccl_above.symmetric": _limit,
    "all_reduce.reduce_scatter_nccl_above.plain": _limit,
    "all_reduce.reduce_scatter_nccl_above.symmetric": _limit,
    "all_reduce.kernel_dtypes.sum": _flags,  # {dtype name: auto gives (op, dtype) the kernels}
    "all_reduce.kernel_dtypes.avg": _flags,
    "all_reduce.kernel_dtypes.max": _flags,
    "all_reduce.kernel_dtypes.min": _flags,
    "all_reduce.kernel_dtypes.product": _flags,
    "ag_gemm.overlap_min_rows": _count,
    "ag_gemm.start": _settings,
    "gemm_rs.medium_speed": _number,
    "gemm_rs.cublas_chunks_below_fill": _number,
    "gemm.configs": _named_settings,
    "gemm.tuned": _tuned_shapes,
    "gemm.skinny_max_m": _count,
    "gemm.small_max_output": _count,
    "gemm_ar.fused_max_m": _count,
    "gemm_ar.configs": _row_configs,
    "flash_decode.split_programs_per_sm": _count,
    "flash_decode.min_blocks_per_split": _count,
    "flash_decode.max_splits": _count,
    "flash_decode.stages_past_one_wave": _count,
    "decode.gemv": _settings,
    "decode.fused_max_m": _per_size,  # {tensor-parallel size: largest batch bucket}
    "decode.persistent": _settings,
    "ulysses.nccl_above": _limit,
    "ulysses.auto_fused": _flag,
    "ulysses.push": _settings,
    "p2p.programs": _count,
    "p2p.kernel_max_bytes": _count,
    "p2p.part_min_bytes": _count,
    "m2n.launch": _settings,
    "moe.ht_programs": _count,
    "moe.ht_block": _settings,
    "moe.ht_copy_programs": _count,
    "moe.ht_route_tokens": _count,
    "moe.ll_launch": _settings,
    "grouped_gemm.configs": _named_settings,
    "grouped_gemm.pointer_config": _settings,
    "grouped_gemm.few_rows_config": _name,
    "moe_tp.tiles": _named_settings,
    "moe_tp.tma_operands": _flag,
    "moe_tp.auto_overlaps": _flags,
}
FAMILIES = tuple(dict.fromkeys(key.split(".")[0] for key in KEYS))


@dataclasses.dataclass(frozen=True)
class Table:
    """One tuning table: where it came from, the GPU model and world size it was measured on, its entries."""
    path: Path
    gpu: str
    world_size: int
    local: bool
    values: dict

    def families(self) -> set[str]:
        return {key.split(".")[0] for key in self.values}

    def describe(self) -> str:
        return f"{'local' if self.local else 'shipped'} {self.path} ({self.gpu}, {self.world_size} ranks)"


def load(path, local: bool = False) -> Table:
    """Read and check one table file; TuningError naming the file (and key) if it is malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TuningError(f"{path}: cannot read a tuning table: {e}") from None
    if not isinstance(data, dict):
        raise TuningError(f"{path}: a tuning table is a JSON object, got {type(data).__name__}")
    gpu, world_size, values = data.get("gpu"), data.get("world_size"), data.get("values")
    if not _name(gpu):
        raise TuningError(f"{path}: key 'gpu' must be a GPU model name, got {gpu!r}")
    if not _is_int(world_size) or world_size < 1:
        raise TuningError(f"{path}: key 'world_size' must be a positive integer, got {world_size!r}")
    if not isinstance(values, dict):
        raise TuningError(f"{path}: key 'values' must be an object of entries, got {type(values).__name__}")
    for key, entry in values.items():
        if key not in KEYS:
            raise TuningError(f"{path}: unknown key {key!r}")
        if not isinstance(entry, dict) or "value" not in entry:
            raise TuningError(f"{path}: key {key!r}: an entry is an object with a 'value', got {entry!r}")
        if not KEYS[key](entry["value"]):
            raise TuningError(f"{path}: key {key!r}: the value must be {KINDS[KEYS[key]]}, got {entry['value']!r}")
    table = Table(path, gpu, world_size, local, {key: entry["value"] for key, entry in values.items()})
    for family in table.families():
        for key in KEYS:
            if key.startswith(family + ".") and key not in table.values:
                raise TuningError(f"{path}: key {key!r} is missing (the table holds other {family} keys)")
    return table


def local_dir() -> Path:
    """Where `weft tune` writes, and lookups look first: $WEFT_TUNING_DIR, else ~/.cache/weft/tuning."""
    return Path(os.environ.get("WEFT_TUNING_DIR") or Path.home() / ".cache" / "weft" / "tuning")


def file_name(gpu: str, world_size: int) -> str:
    return f"{gpu}-x{world_size}.json"


_shipped: list[Table] = []
_tables: dict[str, list[Table]] = {}  # by local directory: the shipped tables, then the local ones
_chosen: dict[tuple, Table] = {}
_overrides: dict[str, object] = {}


def shipped_tables() -> list[Table]:
    """The tables shipped in weft/tuning/data (read once)."""
    if not _shipped:
        _shipped.extend(load(p) for p in sorted(DATA_DIR.glob("*.json")))
    return _shipped


def tables() -> list[Table]:
    """Every table: the shipped ones and those in the local directory (read once per directory)."""
    where = str(local_dir())
    if where not in _tables:
        found = list(shipped_tables())
        if Path(where).is_dir():
            found += [load(p, local=True) for p in sorted(Path(where).glob("*.json"))]
        _tables[where] = found
    return _tables[where]


_memos: list[dict] = []


def memo(fn):
    """`fn` (of hashable arguments, built from lookups) computed once per arguments, until the tables or the
    overrides change: for what code that runs per call (not per plan) derives from the tables."""
    results = {}
    _memos.append(results)

    def cached(*args):
        found = results.get(args)
        if found is None:
            found = results[args] = fn(*args)
        return found
    cached.__doc__, cached.__name__, cached.__wrapped__ = fn.__doc__, fn.__name__, fn
    return cached


def _forget_choices():
    _chosen.clear()
    for results in _memos:
        results.clear()


def reload():
    """Forget the tables read and the choices made (after `weft tune` wrote a table, or the directory changed)."""
    _tables.clear()
    _forget_choices()


def gpu_model(device: torch.device) -> str:
    """The model that names tables: "H200" for "NVIDIA H200", "cpu" off GPUs."""
    if device.type != "cuda":
        return "cpu"
    return _gpu_name(device.index or 0)


def _gpu_name(index: int) -> str:
    words = [w for w in torch.cuda.get_device_name(index).split() if w.upper() not in ("NVIDIA", "TESLA")]
    return words[0] if words else "unknown"


def _gpu_distance(want: str, have: str) -> int:
    if want == have:
        return 0
    arch = ARCHITECTURES.get(want)
    return 1 if arch is not None and arch == ARCHITECTURES.get(have) else 2


def table_for(family: str, gpu: str, world_size: int) -> Table:
    """The table the family's values are read from on `gpu` at `world_size` ranks (see the module doc)."""
    where = (family, gpu, world_size, str(local_dir()))
    chosen = _chosen.get(where)
    if chosen is None:
        holding = [t for t in tables() if family in t.families()]
        if not holding:
            raise TuningError(f"no tuning table holds the {family} keys (looked in {DATA_DIR} and {local_dir()})")
        by_world = family not in PER_GPU

        def rank(t: Table):
            distance = abs(t.world_size - world_size)
            return (_gpu_distance(gpu, t.gpu), distance if by_world else 0, not t.local, distance, -t.world_size)
        chosen = _chosen[where] = min(holding, key=rank)
    return chosen


def value(key: str, device: torch.device, world_size: int = 1):
    """The value of `key` for `device`'s GPU model at `world_size` ranks; a limit of null reads as inf."""
    if key in _overrides:
        found = _overrides[key]
    else:
        if key not in KEYS:
            raise KeyError(f"unknown tuning key {key!r}")
        table = table_for(key.split(".")[0], gpu_model(device), world_size)
        found = table.values[key]  # load() made sure the family's table holds every key of it
    if found is None and KEYS[key] is _limit:
        return float("inf")
    return found


def by_size(key: str, device: torch.device, size: int) -> int:
    """A value given per size (a key of kind {size: value}, as decode.fused_max_m per tensor-parallel size): the
    entry of the largest size not above `size`, or the smallest size's where all are above it."""
    table = value(key, device)
    sizes = sorted(int(s) for s in table)
    return table[str(max((s for s in sizes if s <= size), default=sizes[0]))]


@contextlib.contextmanager
def overrides(values: dict):
    """Take these {key: value} instead of the tables' within the block (for sweeps and tests): clear the
    plans made meanwhile (`weft.world().plans.clear()`) before and after, since plans keep what they looked up."""
    for key, v in values.items():
        if key not in KEYS:
            raise KeyError(f"unknown tuning key {key!r}")
        if not KEYS[key](v):
            raise TuningError(f"override of {key!r}: the value must be {KINDS[KEYS[key]]}, got {v!r}")
    saved = dict(_overrides)
    _overrides.update(values)
    _forget_choices()
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
        _forget_choices()


def sources(device: torch.device, world_size: int) -> dict[str, Table]:
    """The table every family reads from on `device` at `world_size` ranks: {family: Table}."""
    return {family: table_for(family, gpu_model(device), world_size) for family in FAMILIES}


def shipped(key: str) -> list:
    """The distinct values of `key` over the shipped tables (e.g. every GEMM config, for the compile check)."""
    found = []
    for t in shipped_tables():
        if key in t.values and t.values[key] not in found:
            found.append(t.values[key])
    return found


def entries(table: Table) -> dict:
    """The table file's entries, provenance included ({key: {"value": ..., "measured": ..., "note": ...}})."""
    return json.loads(table.path.read_text())["values"]
