"""Bucketed cuDNN chunk attention: bounded shapes so plans are reused. Correctness against
chunk_attention, then first/steady timing on varied (P, C)."""
import sys, time, torch
sys.path.insert(0, ".")
from kestrel_kernels.library_attention import chunk_attention, attend_with_lse, merge_by_lse
H, Hkv, D = 28, 4, 128
dev = "cuda"
def rup(x, b): return (x + b - 1) // b * b
def bucketed(q, kc, vc, slots, P, scale, B=4096, Qb=512):
    C = q.shape[0]
    Pf = P // B * B; r = P - Pf
    S = rup(r + C, Qb)
    k = kc.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1,Hkv,P+C,D]
    v = vc.index_select(0, slots).transpose(0, 1).unsqueeze(0)
    kq = torch.zeros(1, Hkv, S, D, dtype=k.dtype, device=k.device); vq = torch.zeros_like(kq)
    kq[:, :, :r + C] = k[:, :, Pf:]; vq[:, :, :r + C] = v[:, :, Pf:]
    qq = torch.zeros(1, H, S, D, dtype=q.dtype, device=q.device)
    qq[0, :, r:r + C] = q.transpose(0, 1)
    out, lse = attend_with_lse(qq, kq, vq, True, scale)
    out, lse = out[:, :, r:r + C], lse[:, :, r:r + C]
    if Pf:
        Cq = rup(C, Qb)
        qp = torch.zeros(1, H, Cq, D, dtype=q.dtype, device=q.device); qp[0, :, :C] = q.transpose(0, 1)
        o1, l1 = attend_with_lse(qp, k[:, :, :Pf], v[:, :, :Pf], False, scale)
        out = merge_by_lse(o1[:, :, :C], l1[:, :, :C], out, lse)
    return out[0].transpose(0, 1)
S = 40000
kc = torch.randn(S, Hkv, D, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
slots = torch.randperm(S, device=dev)
def t(f):
    torch.cuda.synchronize(); a = time.perf_counter(); f(); torch.cuda.synchronize(); return (time.perf_counter() - a) * 1e3
torch.manual_seed(0)
shapes = [(0, 8192), (8192, 8192), (16384, 8192), (24576, 7001), (0, 7001), (12000, 6100), (12100, 6000), (12345, 5999), (20001, 4321), (5000, 5000), (31000, 1700)]
for P, C in shapes:
    q = torch.randn(C, H, D, device=dev, dtype=torch.bfloat16)
    s = slots[:P + C]
    a = chunk_attention(q, kc, vc, s, P, D ** -0.5)
    fb = lambda: bucketed(q, kc, vc, s, P, D ** -0.5)
    f0 = t(fb); f1 = t(fb); f2 = min(t(fb) for _ in range(3))
    err = (fb().float() - a.float()).abs().max().item()
    fp = lambda: chunk_attention(q, kc, vc, s, P, D ** -0.5)
    p2 = min(t(fp) for _ in range(3))
    print(f"bucketed P={P:<6} C={C:<5} first {f0:8.2f} then {f1:7.2f} best {f2:7.2f} ms | plain best {p2:7.2f} | max err {err:.4f}", flush=True)
