"""C11: the draft runner's backend is the draft-extend backend; draft decode keeps its own."""


def test_c11_draft_backends(tiny_llama_dir):
    from spec_helpers import CHAIN, tiny_engine
    eng = tiny_engine(tiny_llama_dir, *CHAIN)
    eagle = eng.workers[0].eagle
    assert eagle.runner.backend is eagle.extend_backend
    assert eagle.decode_runner.backend is eagle.decode_backend
    assert eagle.decode_backend is not eagle.extend_backend
    # both read the draft's own KV pool, never the target's
    assert eagle.extend_backend.kv_pool is eagle.kv_pool is eagle.decode_backend.kv_pool
    assert eagle.kv_pool is not eng.workers[0].kv_pool
