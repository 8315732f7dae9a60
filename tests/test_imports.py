"""Import boundaries: engines never pull in kopf/kubernetes; the operator never pulls in torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ImportError(f"{{name}} must not be imported here")
    sys.meta_path.insert(0, Block())
""")


def run(blocked: set[str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK.format(blocked=blocked) + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_engine_client_imports_without_kopf_or_kubernetes():
    # nor transformers: only `integrations.transformers` imports it, and the engine only to serve such a model
    proc = run({"kopf", "kubernetes", "transformers"}, """
        from weightcache_agent import CacheSpec, attach
        import weightcache_agent.serve.agent, weightcache_agent.load.loader, weightcache_agent.engine.server
        print("ok", CacheSpec(model="/m").tp_size)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok 1"


def test_operator_command_runs_without_torch():
    proc = run({"torch", "safetensors"}, """
        from weightcache_agent.cli import main
        try:
            main(["operator", "--help"])
        except SystemExit as e:
            assert e.code == 0
        import weightcache_operator.registry, weightcache_operator.controller.weightcache.manifests
    """)
    assert proc.returncode == 0, proc.stderr
    assert "--all-namespaces" in proc.stdout


def test_the_gpu_cold_path_plans_without_torch(tmp_path):
    """Headers, plan and layout need no torch, and the GPU fill of bf16 weights, copied or quantized,
    is the driver's: an agent loading them never reads torch's libraries off the disk it loads from."""
    from weightcache_agent.load.loader import prepare_cache
    from weightcache_agent.spec import CacheSpec
    from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape(), shards=2)
    proc = run({"torch", "safetensors"}, f"""
        from weightcache_agent.load.cuda_fill import driver_fills
        from weightcache_agent.load.loader import prepare_cache
        from weightcache_agent.spec import CacheSpec
        for quant in ("none", "fp8-block"):
            prepared = prepare_cache(CacheSpec(model={model!r}, quantization=quant))
            assert driver_fills(prepared.plan), quant
            print(prepared.layout.layout_hash)
        print(driver_fills(prepare_cache(CacheSpec(model={model!r}, dtype="float16")).plan))
    """)
    assert proc.returncode == 0, proc.stderr
    # the same layouts as planned beside torch; a cast is left to torch's kernels
    expected = [prepare_cache(CacheSpec(model=model, quantization=q)).layout.layout_hash for q in ("none", "fp8-block")]
    assert proc.stdout.split() == [*expected, "False"]


def test_lazy_torch_modules_import_it_where_they_use_it():
    """Modules that import torch only inside functions (so that an agent starts without it) must do so in
    every function that uses it: a name `torch` left to the module's globals is a NameError on a GPU only."""
    import ast
    import pathlib

    import weightcache_agent

    root = pathlib.Path(weightcache_agent.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {a.asname or a.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
               for a in node.names}
        if "torch" in top:
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            uses = any(isinstance(n, ast.Name) and n.id == "torch" and isinstance(n.ctx, ast.Load)
                       for stmt in fn.body for n in ast.walk(stmt))
            imports = any(isinstance(n, ast.Import) and any((a.asname or a.name) == "torch" for a in n.names)
                          for n in ast.walk(fn))
            if uses and not imports:
                missing.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}")
    assert not missing, "uses torch without importing it: " + ", ".join(missing)
