"""What identifies a model on attach: its content and the revision label, never its path.

A real agent serves a synthetic checkpoint. The same bytes under another directory name
attach; an engine that asks for another revision than the agent's is refused, naming
`revision`; an engine that names no revision takes the agent's; edited bytes are refused,
naming `content`.
"""
from __future__ import annotations

import os
import shutil

import pytest

from weightcache_agent import CacheSpec, FingerprintMismatch, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    model = write_llama_checkpoint(str(root / "tiny-llama"), LlamaShape(num_hidden_layers=1))
    with AgentProcess(model, str(root / "a.sock"), "--revision", "v1") as agent:
        yield model, agent


def skeleton(model: str):
    return skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})


def test_the_same_bytes_under_another_directory_name_attach(served, tmp_path):
    model, agent = served
    copy = shutil.copytree(model, tmp_path / "tiny-copy")  # other name, other inodes: content decides
    with attach(skeleton(str(copy)), CacheSpec(model=str(copy)), socket=agent.socket) as att:
        assert att.source == "agent"
        assert att.fields["revision"] == "v1" and "model" not in att.fields


def test_another_revision_is_refused_naming_revision(served):
    model, agent = served
    with pytest.raises(FingerprintMismatch) as refused:
        attach(skeleton(model), CacheSpec(model=model, revision="v2"), socket=agent.socket)
    assert set(refused.value.differences) == {"revision"}
    assert refused.value.differences["revision"] == ("v1", "v2")
    assert "revision: cache=v1 engine=v2" in str(refused.value) and "tiny-llama" in str(refused.value)


def test_the_same_revision_or_none_attaches(served):
    model, agent = served
    for revision in ("v1", None):
        with attach(skeleton(model), CacheSpec(model=model, revision=revision), socket=agent.socket) as att:
            assert att.source == "agent"


def test_edited_bytes_are_refused_naming_content(served, tmp_path):
    model, agent = served
    copy = str(shutil.copytree(model, tmp_path / "tiny-llama"))  # the very name the agent serves
    with open(os.path.join(copy, "config.json"), "a") as f:
        f.write(" ")
    with pytest.raises(FingerprintMismatch) as refused:
        attach(skeleton(copy), CacheSpec(model=copy), socket=agent.socket)
    assert set(refused.value.differences) == {"content"}


def test_a_revision_label_must_be_a_short_string():
    with pytest.raises(ValueError, match="revision"):
        CacheSpec(model="/m", revision="x" * 129)
