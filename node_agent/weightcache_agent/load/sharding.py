"""Sharding plans: which part of each checkpoint tensor one tensor-parallel rank holds.

A plan is an ordered list of `Rule`s (name regex -> mode, dim); the first rule whose
pattern matches a tensor name decides. Presets exist for the common decoder families and
are chosen from `config.json` (`model_type`, then `architectures`); a YAML rules file
(`--sharding FILE`) puts its rules in front of the preset, so it overrides it; a bare
preset name (`--sharding llama`) forces one preset.

    mode        split         who
    column      dim 0         q/k/v, gate/up (and their biases), fused qkv / gate_up
    row         dim 1         o_proj, down_proj (w2)
    vocab       dim 0         embed_tokens, lm_head
    replicated  -             norms, routers, biases of row-parallel layers, the rest

MoE experts (`...experts.<E>...`) split like the dense MLP under plain TP. With expert
parallelism each rank instead holds whole experts `[r*E/N, (r+1)*E/N)` and the others
not at all; expert tensors keep their *global* names (`experts.5.` stays `experts.5.`
on the rank that owns expert 5), so the manifest says which experts a rank holds and
the router's expert ids need no translation.

`Shard.segments` turns a decision into byte ranges of the file: a dim-0 slice is one
contiguous range, a dim-1 slice one short range per row, a fused tensor one range per
part -- the loader reads exactly those bytes and never the rest of the tensor.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from .checkpoint import Checkpoint, TensorRecord
from ..errors import CheckpointError

MODES = ("column", "row", "vocab", "replicated")
_DEFAULT_DIM = {"column": 0, "vocab": 0, "row": 1, "replicated": None}
EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
# config.json fields that hold the number of routed experts, per family.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Rule:
    pattern: str
    mode: str
    dim: int | None = None
    heads: str | None = None  # config field (head count) that must divide by tp_size
    fused: str | None = None  # "qkv": [q | k | v] rows; "halves": [gate | up] rows

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sharding rule {self.pattern!r}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        re.compile(self.pattern)

    @property
    def split_dim(self) -> int | None:
        return self.dim if self.dim is not None else _DEFAULT_DIM[self.mode]


_VOCAB = [Rule(r"(^|\.)embed_tokens\.weight$", "vocab"), Rule(r"(^|\.)lm_head\.weight$", "vocab")]
_ATTN = [
    Rule(r"\.q_proj\.(weight|bias)$", "column", heads="num_attention_heads"),
    Rule(r"\.(k|v)_proj\.(weight|bias)$", "column", heads="num_key_value_heads"),
    Rule(r"\.qkv_proj\.(weight|bias)$", "column", heads="num_key_value_heads", fused="qkv"),
    Rule(r"\.o_proj\.weight$", "row", heads="num_attention_heads"),
]
_MLP = [
    Rule(r"\.(gate|up)_proj\.(weight|bias)$", "column"),
    Rule(r"\.gate_up_proj\.(weight|bias)$", "column", fused="halves"),
    Rule(r"\.down_proj\.weight$", "row"),
]
_MIXTRAL = [Rule(r"\.experts\.\d+\.(w1|w3)\.weight$", "column"), Rule(r"\.experts\.\d+\.w2\.weight$", "row")]
# DeepSeek-V2/V3 MLA: the low-rank down projections (q_a_proj, kv_a_proj_with_mqa) and
# their norms are replicated; the up projections split by heads.
_MLA = [
    Rule(r"\.(q_b_proj|kv_b_proj)\.weight$", "column", heads="num_attention_heads"),
    Rule(r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", "replicated"),
]

PRESETS: dict[str, list[Rule]] = {
    "llama": _VOCAB + _ATTN + _MLP,  # also Mistral, Qwen2, Qwen3 (q_norm/k_norm: replicated)
    "qwen_moe": _VOCAB + _ATTN + _MLP,  # routed experts and shared_expert use the MLP names
    "mixtral": _VOCAB + _ATTN + _MLP + _MIXTRAL,
    "deepseek": _VOCAB + _MLA + _ATTN + _MLP,
}
_MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "qwen2_moe": "qwen_moe", "qwen3_moe": "qwen_moe", "mixtral": "mixtral",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen_moe", "Qwen3MoeForCausalLM": "qwen_moe",
    "MixtralForCausalLM": "mixtral", "DeepseekV2ForCausalLM": "deepseek", "DeepseekV3ForCausalLM": "deepseek",
}


@dataclass(frozen=True)
class ShardingPlan:
    rules: tuple[Rule, ...]
    identity: str  # what the fingerprint records: "preset:llama" or "rules:<hash>+preset:llama"

    def rule_for(self, name: str) -> Rule | None:
        for rule in self.rules:
            if re.search(rule.pattern, name):
                return rule
        return None


# A user's rule is a regular expression run against every tensor name by a backtracking matcher
# (Python's re). Unchecked, 17 characters (`^(\w+\.?)+\.bias$`) took ~42 s per name. Python ships no
# matcher without backtracking, and a running match cannot be interrupted, so the bound is on the
# pattern: what makes backtracking exponential (a quantifier over anything but one character or
# class, alternation or a group under a quantifier, back-references, lookarounds) is refused, and
# so are more than MAX_OPEN_REPEATS quantifiers of more than MAX_SMALL_REPEAT: with at most two,
# a search is at worst cubic in the name's length, and checkpoint names are at most
# checkpoint.MAX_NAME characters (~0.2 s for the worst name; a real one takes microseconds).
MAX_PATTERN = 256
MAX_OPEN_REPEATS = 2
MAX_SMALL_REPEAT = 8


def check_user_pattern(pattern: str) -> None:
    """Refuse a user's sharding pattern a backtracking matcher could spend unbounded time on (ValueError, one line)."""
    import re._constants as c
    import re._parser as sre

    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"pattern of {len(pattern)} characters: at most {MAX_PATTERN}")
    shown = pattern if len(pattern) <= 64 else pattern[:61] + "..."
    repeats = (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT)
    single = (c.LITERAL, c.NOT_LITERAL, c.IN, c.ANY)

    def walk(items: Any) -> int:
        open_repeats = 0
        for op, av in items:
            if op in repeats:
                low, high, body = av
                body = list(body)
                one_char = len(body) == 1 and body[0][0] in single
                plain_optional = high == 1 and not _has(body, repeats + (c.BRANCH,))
                if not (one_char or plain_optional):
                    raise ValueError(f"pattern {shown!r}: a quantifier may apply only to one character or class (or "
                                     "'?' to a group without quantifiers or '|'): nested quantifiers can take "
                                     "exponential time")
                if high == c.MAXREPEAT or high > MAX_SMALL_REPEAT:
                    open_repeats += 1
            elif op == c.SUBPATTERN:
                open_repeats += walk(av[-1])
            elif op == c.BRANCH:
                open_repeats += sum(walk(branch) for branch in av[1])
            elif op in (c.GROUPREF, c.GROUPREF_EXISTS, c.ASSERT, c.ASSERT_NOT, c.ATOMIC_GROUP):
                raise ValueError(f"pattern {shown!r}: back-references and lookarounds are not allowed")
        return open_repeats

    count = walk(sre.parse(pattern))
    if count > MAX_OPEN_REPEATS:
        raise ValueError(f"pattern {shown!r}: {count} open-ended quantifiers (*, +, {{n,}}, or over "
                         f"{MAX_SMALL_REPEAT}); at most {MAX_OPEN_REPEATS}, so that matching stays bounded")


def _has(items: Any, ops: tuple[Any, ...]) -> bool:
    import re._constants as c

    for op, av in items:
        if op in ops:
            return True
        if op == c.SUBPATTERN and _has(av[-1], ops):
            return True
        if op == c.BRANCH and any(_has(b, ops) for b in av[1]):
            return True
    return False


def config_path(checkpoint: Checkpoint) -> str:
    return os.path.join(checkpoint.directory, "config.json")


def require_config(checkpoint: Checkpoint, why: str) -> dict[str, Any]:
    if checkpoint.config is None:
        raise CheckpointError(f"{config_path(checkpoint)}: missing, and {why} needs it")
    return checkpoint.config


def config_int(checkpoint: Checkpoint, fields: tuple[str, ...], why: str) -> int:
    """The first of `fields` present in config.json, as an int; a clear error when none is."""
    config = require_config(checkpoint, why)
    for name in fields:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise CheckpointError(f"{config_path(checkpoint)}: has no {' / '.join(repr(f) for f in fields)} field, "
                          f"which {why} needs")


def preset_for(checkpoint: Checkpoint) -> str:
    config = require_config(checkpoint, "choosing a sharding preset")
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    for arch in config.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise CheckpointError(
        f"{config_path(checkpoint)}: no sharding preset for model_type {model_type!r} / architectures "
        f"{config.get('architectures')!r}; known presets: {', '.join(PRESETS)}. Pass --sharding with a preset "
        "name or a YAML rules file"
    )


def resolve_plan(checkpoint: Checkpoint, sharding: str | None) -> ShardingPlan:
    """The plan for `sharding` (None: preset from config.json; a preset name; or a YAML file)."""
    if sharding is None:
        name = preset_for(checkpoint)
        return ShardingPlan(tuple(PRESETS[name]), f"preset:{name}")
    if sharding in PRESETS:
        return ShardingPlan(tuple(PRESETS[sharding]), f"preset:{sharding}")
    if not os.path.isfile(sharding):
        raise CheckpointError(f"sharding {sharding!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    return _load_rules_file(checkpoint, sharding)


def plan_identity(checkpoint: Checkpoint, sharding: str | None, tp_size: int) -> str:
    """What the fingerprint records about sharding; a single rank needs no preset."""
    if tp_size == 1 and sharding is None:
        return "unsharded"
    return resolve_plan(checkpoint, sharding).identity


MAX_RULES_BYTES = 256 << 10  # a rules file is a few dozen lines


def _load_rules_file(checkpoint: Checkpoint, path: str) -> ShardingPlan:
    """YAML: `{preset: NAME|none (optional), rules: [{pattern, mode, dim?}, ...]}`.

    Only ever the operator-given file of this process (or an engine's own): still read with
    a size cap, from a regular file only, and without YAML aliases, so a small file cannot
    expand into gigabytes.
    """
    import stat

    import yaml

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the sharding rules: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: sharding rules must be a regular file")
        raw = f.read(MAX_RULES_BYTES + 1)
    if len(raw) > MAX_RULES_BYTES:
        raise CheckpointError(f"{path}: sharding rules larger than {MAX_RULES_BYTES} bytes")
    try:
        for event in yaml.parse(raw, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise CheckpointError(f"{path}: YAML aliases are not allowed in sharding rules")
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rules", []), list):
        raise CheckpointError(f"{path}: expected a mapping with a 'rules' list of {{pattern, mode, dim}}")
    rules = []
    for i, entry in enumerate(doc.get("rules") or []):
        if not isinstance(entry, dict) or "pattern" not in entry or "mode" not in entry:
            raise CheckpointError(f"{path}: rule {i}: needs 'pattern' and 'mode', got {entry!r}")
        dim = entry.get("dim")
        if dim is not None and not (isinstance(dim, int) and dim >= 0):
            raise CheckpointError(f"{path}: rule {i} ({entry['pattern']!r}): dim must be a non-negative integer")
        try:
            check_user_pattern(str(entry["pattern"]))
            rules.append(Rule(str(entry["pattern"]), str(entry["mode"]), dim))
        except (ValueError, re.error) as e:
            raise CheckpointError(f"{path}: rule {i}: {e}") from None
    digest = hashlib.sha256(raw).hexdigest()[:16]
    base = doc.get("preset")
    if base == "none":
        return ShardingPlan(tuple(rules), f"rules:{digest}")
    if base is None:
        base = preset_for(checkpoint)
    elif base not in PRESETS:
        raise CheckpointError(f"{path}: preset {base!r} is not one of {', '.join(PRESETS)} (or 'none')")
    return ShardingPlan(tuple(rules) + tuple(PRESETS[base]), f"rules:{digest}+preset:{base}")


# -- this rank's part of one tensor -------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    file_offset: int
    dest_offset: int  # within the tensor's slot, in source-dtype bytes
    nbytes: int


@dataclass(frozen=True)
class Shard:
    """This rank's part of `record`: its shape, and where its bytes are in the file."""

    record: TensorRecord
    shape: tuple[int, ...]
    dim: int | None = None  # split dimension (None: whole tensor)
    parts: tuple[int, ...] = ()  # sizes along `dim` of fused parts, each split separately
    rank: int = 0
    size: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.record.dtype.itemsize

    def segments(self) -> list[Segment]:
        """Byte ranges of the file, in the order they fill the slot; adjacent ones merged."""
        rec = self.record
        if self.dim is None:
            return [Segment(rec.start, 0, rec.nbytes)] if rec.nbytes else []
        full = rec.shape
        outer = math.prod(full[: self.dim])
        inner = math.prod(full[self.dim + 1 :]) * rec.dtype.itemsize
        out: list[Segment] = []
        dest = 0
        for o in range(outer):
            base = rec.start + o * full[self.dim] * inner
            first = 0
            for part in self.parts:
                local = part // self.size
                offset = base + (first + self.rank * local) * inner
                length = local * inner
                if out and out[-1].file_offset + out[-1].nbytes == offset:
                    last = out[-1]
                    out[-1] = Segment(last.file_offset, last.dest_offset, last.nbytes + length)
                elif length:
                    out.append(Segment(offset, dest, length))
                dest += length
                first += part
        return out


def split(record: TensorRecord, dim: int, parts: tuple[int, ...], rank: int, size: int, *, block: int = 1) -> Shard:
    """Take rank `rank` of `size` along `dim`, each of `parts` split separately; check divisibility."""
    where = f"{record.file}: tensor {record.name!r}"
    if dim >= len(record.shape):
        raise CheckpointError(f"{where}: shape {list(record.shape)} has no dim {dim} to split for tensor parallelism")
    for part in parts:
        if part % size:
            raise CheckpointError(
                f"{where}: dim {dim} of size {part} (of shape {list(record.shape)}) does not divide by tp_size {size}"
            )
        if block > 1 and (part // size) % block:
            raise CheckpointError(
                f"{where}: the tp_size {size} slice of dim {dim} is {part // size} wide, which does not fall on "
                f"the {block}-element FP8 block boundary (dim size {part}); its weight_scale_inv blocks would "
                "straddle ranks"
            )
    shape = list(record.shape)
    shape[dim] //= size
    return Shard(record, tuple(shape), dim, parts, rank, size)


def whole(record: TensorRecord) -> Shard:
    return Shard(record, record.shape)


def expert_index(name: str) -> int | None:
    m = EXPERT_RE.search(name)
    return int(m.group(1)) if m else None


def expert_owner(checkpoint: Checkpoint, name: str, expert: int, size: int) -> int:
    """The rank that holds routed expert `expert` under expert parallelism over `size` ranks."""
    count = config_int(checkpoint, EXPERT_COUNT_FIELDS, "expert parallelism (the number of routed experts)")
    if count % size:
        raise CheckpointError(
            f"{config_path(checkpoint)}: {count} routed experts do not divide by {size} expert-parallel ranks "
            f"(tensor {name!r})"
        )
    if expert >= count:
        raise CheckpointError(f"tensor {name!r}: expert {expert} but config.json says there are {count} experts")
    return expert // (count // size)


def fused_parts(checkpoint: Checkpoint, record: TensorRecord, rule: Rule, dim: int) -> tuple[int, ...]:
    """Sizes along `dim` of the separately split parts of a (possibly fused) tensor."""
    total = record.shape[dim] if dim < len(record.shape) else 0
    if rule.fused == "halves":
        if total % 2:
            raise CheckpointError(f"{record.file}: tensor {record.name!r}: fused gate_up dim {dim} of size {total} is odd")
        return (total // 2, total // 2)
    if rule.fused == "qkv":
        why = f"splitting fused tensor {record.name!r}"
        heads = config_int(checkpoint, ("num_attention_heads",), why)
        kv = config_int(checkpoint, ("num_key_value_heads", "num_attention_heads"), why)
        config = checkpoint.config or {}
        head_dim = config.get("head_dim") or config_int(checkpoint, ("hidden_size",), why) // heads
        q, k = heads * head_dim, kv * head_dim
        if q + 2 * k != total:
            raise CheckpointError(
                f"{record.file}: tensor {record.name!r}: dim {dim} is {total} but config.json says q+k+v = "
                f"{heads}*{head_dim} + 2*{kv}*{head_dim} = {q + 2 * k}"
            )
        return (q, k, k)
    return (total,)


def check_heads(checkpoint: Checkpoint, record: TensorRecord, rule: Rule, size: int) -> None:
    """Whole attention heads per rank: a head count that does not divide is an error, not a torn head."""
    if rule.heads is None:
        return
    fields = (rule.heads, "num_attention_heads") if rule.heads == "num_key_value_heads" else (rule.heads,)
    count = config_int(checkpoint, fields, f"splitting {record.name!r} by attention heads")
    if count % size:
        raise CheckpointError(
            f"{record.file}: tensor {record.name!r}: {fields[0]} = {count} does not divide by tp_size {size}"
        )
