"""../2026-12-05-cpu-default-packed/kernels_by_rows.py with the Q4_1 kernel on one instruction
set: auto (AVX-VNNI where the CPU has it) or avx2.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-vnni/kernels_by_rows_isa.py auto|avx2 THREADS"""
import runpy, sys
from pathlib import Path
from kestrel_kernels.cpu_q4 import isa, set_isa
set_isa(sys.argv[1])
print(f"Q4_1 kernel on {isa()}, {sys.argv[2]} threads:", flush=True)
script = Path(__file__).resolve().parent.parent / "2026-12-05-cpu-default-packed" / "kernels_by_rows.py"
sys.argv = [str(script), sys.argv[2]]
runpy.run_path(str(script), run_name="__main__")
