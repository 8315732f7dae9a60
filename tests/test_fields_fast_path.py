"""The agent derives an engine's fields from its own when the engine asks for exactly its spec:
the result must be what parsing the checkpoint gives, field for field."""
from __future__ import annotations

import pytest

from weightcache_agent import CacheSpec
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.fingerprint import (RevisionRequired, engine_request, fields_for_request,
                                                fingerprint_fields, same_spec_fields)
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=2))


@pytest.mark.parametrize("spec_args", [{}, {"quantization": "fp8-block"}, {"dtype": "float16"},
                                       {"tp_size": 2, "tp_rank": 1}, {"revision": "v2"}])
def test_same_spec_gives_the_fields_parsing_gives(model, spec_args):
    spec = CacheSpec(model=model, **spec_args)
    checkpoint = open_checkpoint(model)
    ours = fingerprint_fields(spec, checkpoint, device="cpu")
    for with_revision in (False, True):
        request = engine_request(spec, with_revision=with_revision)
        fast = same_spec_fields(request, spec, ours, checkpoint.signature, checkpoint.revision)
        assert fast == fields_for_request(request, checkpoint)


def test_another_spec_or_other_files_take_the_full_path(model, tmp_path):
    spec = CacheSpec(model=model)
    checkpoint = open_checkpoint(model)
    ours = fingerprint_fields(spec, checkpoint, device="cpu")
    other = engine_request(CacheSpec(model=model, dtype="float16"))
    assert same_spec_fields(other, spec, ours, checkpoint.signature, checkpoint.revision) is None
    request = engine_request(spec)
    request["files"] = "0" * 16  # a copy of the files elsewhere: the content identity must decide
    with pytest.raises(RevisionRequired):
        same_spec_fields(request, spec, ours, checkpoint.signature, checkpoint.revision)
    request["content"] = "f" * 16  # another content: the fields say so
    assert same_spec_fields(request, spec, ours, checkpoint.signature, checkpoint.revision)["content"] == "f" * 16
