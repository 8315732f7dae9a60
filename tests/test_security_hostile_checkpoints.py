"""Hostile checkpoints, as their author would write them, against a real agent process.

Each case writes real files (a FIFO, a symlink, an index naming files outside the model
directory, JSON built to break the parser, FP8 scales that are not numbers) and runs
`weightcache agent` on them. The agent must refuse each with one line naming the file,
exit 1 without a traceback, never hang, and never show bytes of a file it was not meant to
read.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

from loader_fixtures import read_header, write_raw
from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, write_checkpoint, write_llama_checkpoint
from weightcache_agent.testing.synthetic_moe import fp8_config, prequantize

SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)
INDEX = "model.safetensors.index.json"
# What an attacker wants to read: the first 8 bytes of a file outside the model directory.
SECRET = b"SECRET!!root:x:0:0:root:/root:/bin/bash\n"


def run_agent(model: str, sock: str, *extra: str, timeout: float = 90) -> tuple[int, str]:
    """`weightcache agent` on `model`: (exit status, stderr). Fails the test when it hangs."""
    proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                             "--progress", "never", "--backend", "cpu", *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the agent hung on a hostile checkpoint for {timeout:.0f}s:\n{err[-2000:]}")
    return proc.returncode, err


def refused(model: str, tmp_path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    """The agent exits 1 with one line that names each of `needles`, no traceback; that line."""
    code, err = run_agent(model, str(tmp_path / "run" / "agent.sock"), *extra)
    assert code == 1, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    line = next((l for l in err.splitlines() if l.startswith("weightcache agent: ")), "")
    for needle in needles:
        assert needle in line, (needle, err[-3000:])
    return err


def assert_no_secret(err: str) -> None:
    (as_int,) = struct.unpack("<Q", SECRET[:8])
    assert str(as_int) not in err and "SECRET" not in err and "root:x" not in err, err[-2000:]


@pytest.fixture
def model(tmp_path) -> str:
    return write_llama_checkpoint(str(tmp_path / "m"), SHAPE, shards=2)


@pytest.fixture
def secret(tmp_path) -> str:
    path = tmp_path / "outside" / "secret.safetensors"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return str(path)


def rewrite_index(model: str, change) -> None:
    path = os.path.join(model, INDEX)
    with open(path) as f:
        index = json.load(f)
    change(index["weight_map"])
    with open(path, "w") as f:
        json.dump(index, f)


# -- shard names confined to the model directory ------------------------------------------------

@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_index_naming_a_file_outside_the_model_directory_is_refused_without_its_bytes(model, secret, tmp_path, how):
    name = secret if how == "absolute" else os.path.relpath(secret, model)
    assert how != "dotdot" or name.startswith("../")

    def point_outside(weight_map):
        first = next(iter(weight_map))
        weight_map[first] = name
    rewrite_index(model, point_outside)
    err = refused(model, tmp_path, os.path.join(model, INDEX), "not a file name in the model directory")
    assert_no_secret(err)


def test_shard_symlinked_outside_the_model_directory_is_refused_without_its_bytes(model, secret, tmp_path):
    shard = os.path.join(model, "model-00001-of-00002.safetensors")
    os.unlink(shard)
    os.symlink(secret, shard)
    err = refused(model, tmp_path, shard, "outside the model directory")
    assert_no_secret(err)


def test_shard_that_is_not_safetensors_shows_no_bytes_of_it(model, tmp_path):
    """A shard inside the directory whose first 8 bytes are text: the error says what is wrong, not what it read."""
    shard = os.path.join(model, "model-00002-of-00002.safetensors")
    with open(shard, "wb") as f:
        f.write(SECRET * 4)
    err = refused(model, tmp_path, shard, "not a safetensors file")
    assert_no_secret(err)


def test_header_that_is_not_utf8_shows_no_bytes_of_it(model, tmp_path):
    shard = os.path.join(model, "model-00002-of-00002.safetensors")
    header = b"\xfe\xed" + b"x" * 14
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    err = refused(model, tmp_path, shard, "not UTF-8")
    assert "\\xfe" not in err and "0xfe" not in err, err[-2000:]


# -- files that are not files, JSON built to break the parser ------------------------------------

def test_index_that_is_a_fifo_is_refused_at_once(model, tmp_path):
    """Before the fix, the agent blocked opening the FIFO before it ever bound its socket."""
    index = os.path.join(model, INDEX)
    os.unlink(index)
    os.mkfifo(index)
    t0 = time.monotonic()
    refused(model, tmp_path, index, "not a regular file")
    assert time.monotonic() - t0 < 60


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["header", "config", "index"])
@pytest.mark.parametrize("hostile", ["long-int", "deep"])
def test_json_built_to_break_the_parser_is_a_checkpoint_error(model, tmp_path, where, hostile):
    value = "9" * 5000 if hostile == "long-int" else _deep(100_000)
    if where == "header":
        path = os.path.join(model, "model-00002-of-00002.safetensors")
        header, data = read_header(path)
        raw = json.dumps(dict(header, __metadata__="HOLE")).replace('"HOLE"', value).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + data)
    else:
        path = os.path.join(model, "config.json" if where == "config" else INDEX)
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.rstrip().removesuffix("}") + ', "hostile": ' + value + "}")
    refused(model, tmp_path, path)


def test_weight_block_size_not_a_list_is_a_checkpoint_error(tmp_path):
    tensors = prequantize(llama_tensors(SHAPE))
    model = write_checkpoint(str(tmp_path / "fp8"), tensors, dict(fp8_config(SHAPE.config(torch.bfloat16))))
    path = os.path.join(model, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = 128
    with open(path, "w") as f:
        json.dump(config, f)
    refused(model, tmp_path, path, "weight_block_size", extra=("--quantization", "fp8-block"))


def test_duplicate_tensor_names_in_a_header_are_refused(model, tmp_path):
    path = os.path.join(model, "model-00002-of-00002.safetensors")
    header, data = read_header(path)
    name = next(n for n in header if n != "__metadata__")
    entry = json.dumps(header[name])
    raw = json.dumps(header).encode()
    # The same key twice: json.loads keeps the last, safetensors refuses the file.
    raw = raw[:-1] + f', {json.dumps(name)}: {entry}}}'.encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    refused(model, tmp_path, path, repr(name), "more than once")


def test_shape_beyond_int64_is_refused(model, tmp_path):
    path = os.path.join(model, "model-00002-of-00002.safetensors")
    header, data = read_header(path)
    header["model.hostile.weight"] = {"dtype": "BF16", "shape": [0, 2**70], "data_offsets": [0, 0]}
    write_raw(path, header, data)
    refused(model, tmp_path, path, "'model.hostile.weight'", "shape")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_checkpoint_with_non_finite_scales_is_refused(tmp_path, bad):
    tensors = prequantize(llama_tensors(SHAPE))
    scale = next(n for n in sorted(tensors) if n.endswith("weight_scale_inv"))
    tensors[scale] = tensors[scale].clone()
    tensors[scale].view(-1)[0] = bad
    model = write_checkpoint(str(tmp_path / "fp8"), tensors, dict(fp8_config(SHAPE.config(torch.bfloat16))))
    refused(model, tmp_path, repr(scale), "non-finite", extra=("--quantization", "fp8-block"))


def test_node_worker_that_never_answers_is_killed(model, tmp_path):
    """A worker stuck before it binds its socket (as a hung read of a checkpoint would leave it: here
    stopped with SIGSTOP before it could bind) is killed once silent past the bound, like one that
    stopped answering later. Before, a worker that had never answered was waited on forever."""
    from weightcache_agent.arena.devices import Device
    from weightcache_agent.serve.supervisor import KILL_AFTER, NodeConfig, Worker

    config = NodeConfig(model=model, socket_dir=str(tmp_path / "s"), tp_size=1, backend="cpu")
    worker = Worker(0, Device("cpu", "cpu-0", 0), config, out=open(os.devnull, "w"))
    worker.spawn()
    proc = worker.proc
    os.kill(proc.pid, signal.SIGSTOP)  # before the interpreter has started: it never binds
    try:
        worker.tick(time.monotonic())  # no answer: not yet past the bound
        assert proc.poll() is None
        worker.tick(time.monotonic() + KILL_AFTER + 1)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("pattern", [r"^(\w+\.?)+\.bias$", r"(a|aa)*\.weight$", r"\w*\w*\w*\.bias$"])
def test_sharding_rule_that_would_backtrack_for_ever_is_refused_at_once(model, tmp_path, pattern):
    """A 17-character rule took ~42 s per tensor name before: the agent sat in the plan for hours."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(json.dumps({"rules": [{"pattern": pattern, "mode": "replicated"}]}))  # JSON is YAML
    t0 = time.monotonic()
    code, err = run_agent(model, str(tmp_path / "run" / "agent.sock"), "--tp-size", "2", "--tp-rank", "0",
                          "--sharding", str(rules), timeout=60)
    assert code == 1 and "Traceback" not in err, (code, err[-2000:])
    line = next(l for l in err.splitlines() if l.startswith("weightcache agent: "))
    assert str(rules) in line and "rule 0" in line, line
    assert time.monotonic() - t0 < 30


def test_tensor_name_longer_than_any_real_one_is_refused(model, tmp_path):
    path = os.path.join(model, "model-00002-of-00002.safetensors")
    header, data = read_header(path)
    header["x" * 600] = {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]}
    write_raw(path, header, data)
    refused(model, tmp_path, path, "600 characters")
