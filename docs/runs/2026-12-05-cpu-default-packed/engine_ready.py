import sys, time
t0=time.perf_counter()
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
t1=time.perf_counter()
e=LLMEngine(load_config(overrides=[a for a in sys.argv[1:]]))
print(f"import {t1-t0:.1f}s engine {time.perf_counter()-t1:.1f}s", flush=True)
