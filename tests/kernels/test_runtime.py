"""Compiling and launching: one launcher per spec, the direct launch path, the kernel log that
a GPU run writes and tools/precompile_cache.py reads back."""

import importlib.util
import pathlib
import sys
from unittest import mock

import pytest

from flash_qla_cp.kernels import runtime
from flash_qla_cp.kernels.hopper.bwd_fused import build_bwd_fused_ws_kernel
from flash_qla_cp.kernels.hopper.fwd_fused_ws4 import build_fused_fwd_ws4_kernel
from flash_qla_cp.kernels.hopper.prepare import build_prepare_kernel
from flash_qla_cp.kernels.runtime import KernelSpec

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def _precompile_cache_module():
    spec = importlib.util.spec_from_file_location("precompile_cache", TOOLS / "precompile_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_compiled_here(on_jit, on_call=lambda args: None):
    """A stand-in for a kernel TileLang compiled in this process: its adapter gives a tvm
    Executable whose jit() (the host library's build) calls on_jit and returns a module whose
    entry calls on_call with the launch's arguments."""

    class Module:
        def main(self, *args):
            on_call(args)

    class Executable:
        def jit(self):
            on_jit()
            return Module()

    class Adapter:
        def _get_executable(self):
            return Executable()

    class Kernel:
        adapter = Adapter()

    return Kernel()


def test_specs_are_equal_and_hashable_by_value():
    a = KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True)
    b = KernelSpec.of(build_prepare_kernel, is_varlen=True, dtype="bfloat16", K=128, HV=4, H=2)
    assert a == b and hash(a) == hash(b) and a.kwargs["K"] == 128
    assert a.replace(K=64) != a and a.replace(K=64).kwargs["K"] == 64


def test_logged_kernels_read_back_as_specs(tmp_path, monkeypatch):
    log = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(runtime.KERNEL_LOG_ENV, str(log))
    logged = [
        KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True),
        KernelSpec.of(build_bwd_fused_ws_kernel, H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128**-0.5,
                      use_dht=True, store_dh0=False),
        KernelSpec.of(build_fused_fwd_ws4_kernel, H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128**-0.5,
                      use_initial_state=False, store_final_state=False, state_v_first=False,
                      block_v=128, gated_norm=(12352, 512, 768, 1e-06)),  # (a tuple parameter)
    ]
    for spec in logged:
        runtime._log_kernel(spec)
    read = _precompile_cache_module().load_log(str(log))
    assert read == logged and len(set(read)) == len(logged)


def test_no_log_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.KERNEL_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    runtime._log_kernel(KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=64, dtype="bfloat16", is_varlen=False))
    assert list(tmp_path.iterdir()) == []


def test_launcher_calls_the_module_entry_it_loaded_when_compiled():
    """compile_kernel hands out one launcher per spec that passes the arguments straight to the
    module's entry function, looked up once, when the kernel was compiled."""
    pytest.importorskip("tilelang")
    entry_calls, lookups, compiled_specs = [], [], []

    class Module:
        def main(self, *args):
            entry_calls.append(args)

    class Adapter:
        def __init__(self, executable):
            self.executable = executable

        def _get_executable(self):
            lookups.append(1)
            return self.executable

    class Kernel:
        def __init__(self, executable):
            self.adapter = Adapter(executable)

    def factory(n):
        compiled_specs.append(n)
        return ("prim_func", n)

    def compile_(prim_func, **kw):
        return Kernel(Module())  # as loaded from TileLang's disk cache

    with mock.patch("tilelang.compile", compile_), mock.patch.dict(runtime._launchers, clear=True):
        launch = runtime.compile_kernel(KernelSpec.of(factory, n=3))
        assert runtime.compile_kernel(KernelSpec.of(factory, n=3)) is launch
        assert lookups == [1] and compiled_specs == [3]  # built and loaded once
        launch("a", 1)
        launch("b", 2)
        assert runtime.compile_kernel(KernelSpec.of(factory, n=4)) is not launch
        assert entry_calls == [("a", 1), ("b", 2)] and lookups == [1, 1]


def test_kernels_compiled_in_this_process_get_their_modules_loaded_in_the_compile_pool(monkeypatch, tmp_path):
    """A kernel compiled in this process (a tvm Executable) has its module loaded (here, with no
    saved library, its host library built by jit()) in the pool's threads, in parallel, not one
    by one at the first launches."""
    import threading

    tilelang = pytest.importorskip("tilelang")
    monkeypatch.setattr(tilelang.env, "TILELANG_CACHE_DIR", str(tmp_path))
    built_in, entry_calls = [], []

    def kernel():
        return _kernel_compiled_here(lambda: built_in.append(threading.current_thread().name), entry_calls.append)

    def factory(n):
        return ("prim_func", n)

    with mock.patch("tilelang.compile", lambda prim_func, **kw: kernel()), \
            mock.patch.dict(runtime._launchers, clear=True), \
            mock.patch.object(runtime.prim_func_store, "prim_func", lambda spec: spec.build()):
        runtime.precompile([KernelSpec.of(factory, n=n) for n in range(3)], num_workers=2)
        assert len(built_in) == 3 and all(name.startswith("flash-qla-cp-compile") for name in built_in)
        runtime.compile_kernel(KernelSpec.of(factory, n=1))("x")
    assert entry_calls == [("x",)] and len(built_in) == 3


class _FakeKernel:
    adapter = None

    def __init__(self, func=None):
        self.func = func


class _FakePrimFunc:
    """A stand-in for a kernel's PrimFunc (named by its spec)."""

    def __init__(self, name):
        self.name = name


def test_a_plan_compiles_all_its_kernels_at_once_slow_lowering_first_on_first_use(monkeypatch, tmp_path, caplog):
    """compile_plan: one parallel compile of every kernel the forward plan and its backward
    companion name, logged (how many, where, how long) and recorded as one round, then nothing. The fused backward walk
    (`lowers_slowly`) is built and handed to the pool first, though its plan comes second, and
    compiles while the other PrimFuncs are still being built (their builders wait here until it
    has started: without the pipelining they would time out)."""
    import threading

    tilelang = pytest.importorskip("tilelang")
    from flash_qla_cp.kernels.backward import plan_backward
    from flash_qla_cp.kernels.forward import plan_forward

    monkeypatch.setattr(tilelang.env, "TILELANG_CACHE_DIR", str(tmp_path))
    walk_started = threading.Event()
    events = []

    def build(spec):
        if spec.factory is not build_bwd_fused_ws_kernel:
            events.append(("built before the walk started", spec.name, walk_started.wait(timeout=10)))
        return _FakePrimFunc(spec.name)

    def compile_stub(func, **kw):
        events.append(("compile", func.name))
        if func.name == build_bwd_fused_ws_kernel.__name__:
            walk_started.set()
        return _FakeKernel(func)

    monkeypatch.setattr(tilelang, "compile", compile_stub)
    monkeypatch.setattr(KernelSpec, "build", build)  # no lowering needed here
    monkeypatch.setattr(runtime, "_launchers", {})
    monkeypatch.setattr(runtime, "_ready_plans", set())
    forward = plan_forward(16, 32, 128, 128, "bfloat16", 0.1, False, False, False, False, 8, 132, save_states=True)
    backward = plan_backward(16, 32, 128, 128, "bfloat16", 0.1, False, False, 8, 132, states_saved=True)
    specs = [*forward.specs(), *backward.specs()]
    assert build_bwd_fused_ws_kernel.__name__ in [s.name for s in backward.specs()]
    with caplog.at_level("INFO", logger="flash_qla_cp.kernels.runtime"), runtime.recorded_rounds() as rounds:
        runtime.compile_plan(forward, backward)
        runtime.compile_plan(forward, backward)
    names = [spec.name for spec in dict.fromkeys(specs)]
    assert [r["kernels"] for r in rounds] == [len(names)] and rounds[0]["s"] >= 0  # (the second: nothing to build)
    assert [r.getMessage().split(" TileLang kernel(s) ")[0] for r in caplog.records] == [str(len(names))] * 2
    assert str(tmp_path) in caplog.records[0].getMessage() and " ready in " in caplog.records[1].getMessage()
    compiled = [e[1] for e in events if e[0] == "compile"]
    assert sorted(compiled) == sorted(names) and len(names) >= 3
    assert compiled[0] == build_bwd_fused_ws_kernel.__name__
    assert all(e[2] for e in events if e[0] != "compile")
    assert all(runtime._launchers[spec].kernel.func.name == spec.name for spec in specs)
    assert (tmp_path / "flash_qla_cp.lock").exists()


def test_a_failed_compile_in_a_round_raises_and_registers_nothing(monkeypatch, tmp_path):
    """One kernel of a round failing to compile: the error reaches the caller once the pool has
    drained, no launcher of the round is kept (a later call compiles them again), the lock is free,
    and Python's thread switch interval, short while the round compiled, is back to what it was."""
    tilelang = pytest.importorskip("tilelang")
    from flash_qla_cp.kernels.backward import plan_backward

    monkeypatch.setattr(tilelang.env, "TILELANG_CACHE_DIR", str(tmp_path))
    compiled = []

    def compile_stub(func, **kw):
        compiled.append(func.name)
        assert sys.getswitchinterval() == pytest.approx(runtime.COMPILE_SWITCH_INTERVAL_S)  # short GIL turns
        if func.name == "build_bwd_dh_ws_kernel":
            raise RuntimeError("nvcc failed")
        return _FakeKernel(func)

    monkeypatch.setattr(tilelang, "compile", compile_stub)
    monkeypatch.setattr(KernelSpec, "build", lambda self: _FakePrimFunc(self.name))
    monkeypatch.setattr(runtime, "_launchers", {})
    monkeypatch.setattr(runtime, "_ready_plans", set())
    plan = plan_backward(2, 4, 128, 128, "bfloat16", 0.1, True, True, 1, 132)
    before = sys.getswitchinterval()
    assert before > runtime.COMPILE_SWITCH_INTERVAL_S
    with pytest.raises(RuntimeError, match="nvcc failed"):
        runtime.compile_plan(plan)
    assert sorted(compiled) == sorted(spec.name for spec in plan.specs())  # (the others still ran)
    assert sys.getswitchinterval() == before  # (restored, though the round failed)
    assert runtime._launchers == {} and runtime._ready_plans == set()
    monkeypatch.setattr(tilelang, "compile", lambda func, **kw: _FakeKernel(func))
    runtime.compile_plan(plan)  # (a lock left held would hang here)
    assert all(runtime.compiled(spec) for spec in plan.specs())


def _compile_in_a_process(cache_dir, log, name):
    """A process that compiles one kernel (a stand-in that takes a second), noting when."""
    import time

    import tilelang

    from flash_qla_cp.kernels import runtime as rt
    from flash_qla_cp.kernels.runtime import KernelSpec as Spec

    tilelang.env.TILELANG_CACHE_DIR = cache_dir

    def slow_compile(func, **kw):
        with open(log, "a") as f:
            f.write(f"{name} start {time.time()}\n")
        time.sleep(1.0)
        with open(log, "a") as f:
            f.write(f"{name} end {time.time()}\n")
        return _FakeKernel()

    tilelang.compile = slow_compile
    Spec.build = lambda self: self.name
    rt.compile_kernel(Spec.of(build_prepare_kernel, H=1, HV=1, K=64, dtype="bfloat16", is_varlen=False))


def test_processes_compiling_together_take_turns(tmp_path):
    """Ranks that start together compile one at a time (a file lock in the kernel cache): the
    second then finds the first's kernel in TileLang's disk cache instead of building it too."""
    pytest.importorskip("tilelang")
    import multiprocessing

    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_compile_in_a_process, args=(str(tmp_path), str(log), n)) for n in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    events = sorted((float(t), who, what) for who, what, t in (line.split() for line in log.read_text().splitlines()))
    assert [what for _, _, what in events] == ["start", "end", "start", "end"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1]


def test_precompile_lists_every_kernel_the_benchmark_calls_launch():
    """`python -m flash_qla_cp.precompile` enumerates the plans; the kernels real calls launch
    (recorded on the CPU for the benchmark's shapes: dense, packed, split, fwd+bwd) are among
    them, so a precompiled cache leaves nothing to compile."""
    import sys

    sys.path.insert(0, str(TOOLS))
    from precompile_cache import bench_shape_specs

    from flash_qla_cp.precompile import head_config_specs, main

    listed = set(head_config_specs(16, 32, 128, 128, "bfloat16", 132)) | set(head_config_specs(2, 4, 128, 128,
                                                                                               "bfloat16", 132))
    launched = bench_shape_specs(["tp1_1x8k", "tp1_4x8k", "tp1_varlen8_32k", "tp8_1x32k", "tp8_1x128k"])
    missing = [s for s in launched if s not in listed]
    assert not missing, [(s.name, s.kwargs) for s in missing]
    assert main(["--heads", "2", "--v-heads", "4", "--head-dim", "64", "--sms", "132", "--list"]) == 0
    assert main(["--heads", "2", "--v-heads", "4", "--sms", "132", "--layer", "qwen3_next", "--list"]) == 0
    with pytest.raises(SystemExit):
        main(["--heads", "3", "--v-heads", "4", "--sms", "132", "--list"])


def test_precompile_with_layer_lists_every_kernel_the_layer_benchmark_launches():
    """`python -m flash_qla_cp.precompile --layer qwen3_next` covers our GatedDeltaNet: every kernel
    its fwd+bwd and its inference forward (the walk applying the gated norm) launch at the layer
    benchmark's Qwen3-Next shapes (dense and packed, with and without kept states; recorded on
    the CPU) is listed."""
    import sys

    sys.path.insert(0, str(TOOLS))
    from precompile_cache import layer_shape_specs

    from flash_qla_cp.precompile import head_config_specs, layer_specs

    listed = set(head_config_specs(16, 32, 128, 128, "bfloat16", 132))
    listed |= set(layer_specs(16, 32, 128, 128, "bfloat16", "qwen3_next", 4, False, 1e-6, 132))
    launched = layer_shape_specs(["qwen3_next_4x8k", "qwen3_next_varlen8_32k"])
    missing = [s for s in launched if s not in listed]
    assert launched and not missing, [(s.name, s.kwargs) for s in missing]


def test_precompile_reads_a_hugging_face_config(tmp_path, capsys):
    """`--config` (a Qwen3-Next config.json, or a multimodal Qwen3.5 model directory whose text
    config holds the layer) lists what the same heads, dims, layout, conv width, eps and dtype
    given as flags list; flags that the config sets, or a config of another model, are refused."""
    transformers = pytest.importorskip("transformers")
    from flash_qla_cp.precompile import main

    def listed(argv):
        assert main([*argv, "--sms", "132", "--list"]) == 0
        return capsys.readouterr().out

    next_config = transformers.Qwen3NextConfig(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=64, linear_value_head_dim=128,
                                               linear_conv_kernel_dim=3, rms_norm_eps=1e-5, dtype="float16")
    next_config.save_pretrained(tmp_path / "next")
    assert listed(["--config", str(tmp_path / "next" / "config.json")]) == listed(
        ["--heads", "2", "--v-heads", "4", "--head-k-dim", "64", "--head-v-dim", "128", "--layer", "qwen3_next",
         "--conv-size", "3", "--norm-eps", "1e-5", "--dtype", "fp16"])
    text = dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    transformers.Qwen3_5Config(text_config=text, dtype="float16").save_pretrained(tmp_path / "qwen3_5")
    assert listed(["--config", str(tmp_path / "qwen3_5")]) == listed(
        ["--heads", "2", "--v-heads", "4", "--head-dim", "64", "--layer", "qwen3_5", "--dtype", "fp16"])
    assert listed(["--config", str(tmp_path / "qwen3_5"), "--dtype", "bf16"]) == listed(
        ["--heads", "2", "--v-heads", "4", "--head-dim", "64", "--layer", "qwen3_5"])
    for argv in (["--config", str(tmp_path / "next"), "--v-heads", "8"], ["--config", str(tmp_path / "none")],
                 ["--config", str(tmp_path / "next"), "--heads", "2"]):
        with pytest.raises(SystemExit):
            main([*argv, "--sms", "132", "--list"])
    (tmp_path / "llama.json").write_text('{"model_type": "llama", "hidden_size": 256}')
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "llama.json"), "--sms", "132", "--list"])
    assert "not a Qwen3-Next / Qwen3.5 config" in capsys.readouterr().err


def test_tune_layer_lists_its_variants_as_a_kernel_log(tmp_path):
    """tools/tune_layer.py --kernel-log: every step with every variant it times, readable by
    tools/precompile_cache.py --log (so a GPU call of the sweep compiles nothing); each step's
    first variant is the layer's own kernel."""
    import sys

    sys.path.insert(0, str(TOOLS))
    import tune_layer
    from precompile_cache import load_log

    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.kernels import layer as steps

    log = tmp_path / "variants.jsonl"
    tune_layer.main(["--shapes", "recipe_1x32k", "--kernel-log", str(log)])
    specs = load_log(str(log))
    assert specs == tune_layer.variant_specs("recipe_1x32k")
    assert len(set(specs)) == len(specs) == sum(len(v) for v in tune_layer.VARIANTS.values())
    lay = GatedDeltaNet(1024, 8, 16, 128, 128).projection_layout
    inputs = steps.plan_layer_inputs(lay, 4, "bfloat16", False, 2)
    norm = steps.plan_gated_norm(lay, "bfloat16", 1e-6)
    assert {inputs.forward, inputs.backward, norm.forward, norm.backward} <= set(specs)


def test_tune_prepare_lists_its_variants_as_a_kernel_log(tmp_path):
    """tools/tune_prepare.py --kernel-log: the prepare kernel of each shape with each register cap
    and number of v-heads per block its GVA group allows, the plans' own among them (so a GPU call
    of the sweep compiles nothing)."""
    import sys

    sys.path.insert(0, str(TOOLS))
    import tune_prepare
    from precompile_cache import load_log

    from flash_qla_cp.kernels.backward import plan_backward

    log = tmp_path / "variants.jsonl"
    tune_prepare.main(["--shapes", "tp1_1x32k,tp1_varlen8_32k", "--kernel-log", str(log)])
    specs = load_log(str(log))
    listed = [spec for shape in ("tp1_1x32k", "tp1_varlen8_32k") for _, _, spec in tune_prepare.variant_specs(shape)]
    assert specs == listed
    # TP1's group of 2 v-heads per qk-head: one or two per block
    assert len(set(specs)) == len(specs) == 2 * 2 * len(tune_prepare.BLOCKS_PER_SM)
    assert {spec.kwargs["heads_per_block"] for spec in specs} == {1, 2}
    assert plan_backward(16, 32, 128, 128, "bfloat16", 1.0, False, False, 1, 132).prepare in specs


def test_a_kernel_compiled_here_loads_the_library_the_cache_saved_instead_of_building_it_again(tmp_path):
    """TileLang's cache has just exported the kernel's host library: the launcher loads that
    file; only without one (cache disabled) does it build the library again (jit())."""
    built, loaded = [], []

    (tmp_path / "executable.so").write_bytes(b"")
    cached = _kernel_compiled_here(lambda: built.append(1))
    cached._tilelang_cache_path = str(tmp_path)
    with mock.patch.object(runtime, "tilelang_runtime_module", lambda path: loaded.append(path) or mock.Mock()):
        runtime.DirectLaunch(cached)
        assert loaded == [str(tmp_path / "executable.so")] and built == []
        runtime.DirectLaunch(_kernel_compiled_here(lambda: built.append(1)))  # no saved library
        assert built == [1] and len(loaded) == 1


@pytest.mark.parametrize("argv, words", [
    (["--heads", "2", "--head-dim", "96", "--sms", "132"], "support head dims"),
    (["--heads", "2", "--sms", "0"], "--sms must be a positive SM count"),
    (["--heads", "2", "--sms", "132", "--workers", "0"], "--workers must be at least 1"),
    (["--heads", "2", "--sms", "132", "--layer", "qwen3_next", "--norm-eps", "-1"], "--norm-eps must be"),
])
def test_precompile_refuses_bad_flags(argv, words, capsys):
    # a clear message instead of kernels the op would never launch, or a crash deep inside
    from flash_qla_cp.precompile import main

    with pytest.raises(SystemExit):
        main([*argv, "--list"])
    assert words in capsys.readouterr().err
