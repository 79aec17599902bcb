"""Shared fixtures: the default model loaded once per test session (fp32 for exactness)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "spec"))  # spec_helpers
sys.path.insert(0, str(ROOT / "tests"))  # kestrel_testing

# Before any test module imports triton (actors import kestrel_kernels.spec_ops): without CUDA the
# Triton kernels under test run in its interpreter, which is bound when they are decorated.
import triton_interpreter  # noqa: E402,F401
from kestrel_testing import mt_bench_first_turns, q4_kernel_on  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def gguf_read_once():
    """Dequantize each GGUF file once per test session (~5 s for SmolLM2 on 2 cores): the
    shared fp32 worker, the spec workers of the losslessness tests, the warm-up test's
    worker and test_llama_model each build a model from it. Each caller still gets its
    own arch and dict (the tensors are only read: load_weights copies them into the
    model's parameters), and the first read per file is the real reader."""
    import copy

    from actors.models import gguf_loader
    real = gguf_loader.read_gguf
    cache: dict = {}

    def read_gguf(path):
        key = (os.path.realpath(path), os.path.getmtime(path))
        if key not in cache:
            cache[key] = real(path)
        arch, state = cache[key]
        return copy.deepcopy(arch), dict(state)

    gguf_loader.read_gguf = read_gguf
    yield
    gguf_loader.read_gguf = real


@pytest.fixture(scope="session", autouse=True)
def gguf_parsed_once():
    """Parse each GGUF file's header once per test session. gguf's GGUFReader walks every
    metadata field (SmolLM2's 49k-token vocabulary: ~4 s on 2 cores); transformers' model
    loader (hf_model) and its tokenizer conversion each open one. The reader only maps the
    file read-only, so one object serves them all; a file written since (another mtime or
    size) gets a new one."""
    import gguf
    real = gguf.GGUFReader
    cache: dict = {}

    def reader(path, mode="r"):
        if mode != "r":
            return real(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        if key not in cache:
            cache[key] = real(path, mode)
        return cache[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = real


@pytest.fixture(scope="session", autouse=True)
def small_rows_measured_once():
    """Time F.linear against weight @ x^T once per weight shape per test session: a float32
    RankWorker (model.cpu_small_rows=auto) times both on its MLP and LM head weights (~1.5 s
    for SmolLM2 on 2 cores), and dozens are built. The choice is process-wide
    (small_rows_linear.set_enabled), so one measurement also keeps every worker of the
    session on the same path, where fresh ones could flip it between two workers whose
    outputs a test compares."""
    from kestrel_kernels import small_rows_linear
    real = small_rows_linear.measure
    cache: dict = {}

    def measure(weight, rows=small_rows_linear.MAX_ROWS, repeats=30):
        key = (tuple(weight.shape), weight.dtype, weight.device.type, rows, repeats)
        if key not in cache:
            cache[key] = real(weight, rows, repeats)
        return cache[key]

    small_rows_linear.measure = measure
    yield
    small_rows_linear.measure = real


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures(...)`): on
    the 2 shared cores, two OpenMP threads fighting other processes made a tiny training
    step 30x slower than one thread does."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["auto", "avx2"])
def q4_isa(request):
    """A test on each of the Q4_1 kernel's paths (AVX2 twice where the CPU lacks AVX-VNNI)
    -> the instruction set it runs."""
    from kestrel_kernels.cpu_q4 import isa
    with q4_kernel_on(request.param):
        yield isa()


@pytest.fixture
def avx_vnni() -> None:
    """Skips a test where the Q4_1 kernel cannot run VNNI (AVX-VNNI or AVX512-VNNI)."""
    from kestrel_kernels.cpu_q4 import isa
    with q4_kernel_on("auto"):
        if isa() == "avx2":
            pytest.skip("the CPU lacks VNNI (neither avx_vnni nor avx512_vnni with avx512vl in "
                        "/proc/cpuinfo): the Q4_1 kernel runs its AVX2 path only")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from actors.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    from serve_app.text.tokenizer import load_tokenizer
    return load_tokenizer(smollm_path)


@pytest.fixture(scope="session")
def fp32_worker():
    """One fp32 RankWorker shared by engine tests: schedulers are cheap, weights are not."""
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config
    cfg = load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=8192",
                                 "scheduler.max_running_requests=16", "device=cpu",
                                 "draft.enabled=false"])
    return RankWorker(cfg)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    from serve_app.text.tokenizer import apply_chat_template
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}])
            for q in mt_bench_first_turns(8)]


@pytest.fixture(scope="session")
def plain_chat_outputs(fp32_worker, tokenizer, chat_prompts) -> list[list[int]]:
    """Greedy output ids (64 tokens each, EOS ignored) of the plain fp32 engine for the 8
    chat prompts, in one batch: the reference of test_engine.py and of the C22
    losslessness tests (which compare a prefix), computed once."""
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    cfg = load_config(overrides=["draft.enabled=false", "model.dtype=float32",
                                 "kv_cache.num_slots=8192", "scheduler.max_running_requests=16",
                                 "device=cpu"])
    eng = LLMEngine(cfg, tokenizer=tokenizer, workers=[fp32_worker])
    reqs = eng.generate(chat_prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    return [list(r.output_ids) for r in reqs]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A small random Llama saved as an HF folder: fast stand-in target for spec tests.
    A wide init makes its logits peaked, so greedy ties (and fp32 flips) are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def grammar_model(tmp_path_factory, tokenizer) -> str:
    """A small random Llama with SmolLM2's vocabulary and tokenizer, for structured outputs
    (the grammar engine needs a real tokenizer; a random model shows the grammar, not the
    model, shapes the output). A wide init, so greedy ties are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("grammar_model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 1-layer Llama (hidden 32) with SmolLM2's vocabulary and tokenizer
    (benchmarks/http_bench.py), for tests about plumbing rather than the model: it loads
    in a second where SmolLM2 takes 8 s (in a Ray replica or a CLI subprocess, more)."""
    from benchmarks.http_bench import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """transformers' own SmolLM2 from the same GGUF: the reference and the tie oracle.

    Its GGUF loader parses the file twice (config, then weights; gguf_parsed_once makes
    that one parse) and rebuilds gguf's tensor-name table once per module (~400 times):
    memoized while it loads, the same load takes half the time (27 -> 14 s on 2 cores),
    weights bit for bit the same."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path),
            dtype=torch.float32).eval()
