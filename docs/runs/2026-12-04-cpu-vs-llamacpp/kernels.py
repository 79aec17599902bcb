"""The kernel table of docs/benchmarks.md, "The CPU step": ms per forward of the 30 layers' projections
(weights rotating, so read from memory) and of the LM head, at the row counts given."""
import torch, time, sys
torch.set_num_threads(2)
L=30
def bench(fs, n=3):
    for f in fs: f()
    t=time.perf_counter()
    for _ in range(n):
        for f in fs: f()
    return (time.perf_counter()-t)/n*1e3
shapes={'qkv':(960,576),'o':(576,576),'gu':(3072,576),'down':(576,1536)}
Ms=[int(a) for a in sys.argv[1:]] or [1,4]
ws={k:[torch.randn(N,K) for _ in range(L)] for k,(N,K) in shapes.items()}
pk={k:[torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0,16,(N,K),dtype=torch.int32),1) for _ in range(L)] for k,(N,K) in shapes.items()}
szs={k:torch.rand(K//32,N,2) for k,(N,K) in shapes.items()}
w8={k:[torch.randint(-127,127,(N,K),dtype=torch.int8) for _ in range(L)] for k,(N,K) in shapes.items()}
for M in Ms:
    r={}
    xs={k:torch.randn(M,K) for k,(N,K) in shapes.items()}
    r['f32']=bench([lambda k=k,i=i: torch.nn.functional.linear(xs[k],ws[k][i]) for k in shapes for i in range(L)])
    for dt in (torch.bfloat16,):
        xd={k:v.to(dt) for k,v in xs.items()}; sd={k:v.to(dt) for k,v in szs.items()}
        r['i4'+str(dt)[-4:]]=bench([lambda k=k,i=i: torch.ops.aten._weight_int4pack_mm_for_cpu(xd[k],pk[k][i],32,sd[k]) for k in shapes for i in range(L)])
        r['i8'+str(dt)[-4:]]=bench([lambda k=k,i=i: torch.ops.aten._weight_int8pack_mm(xd[k],w8[k][i],sd[k][0,:,0].contiguous()) for k in shapes for i in range(L)])
    print('layers M',M,{k:round(v,2) for k,v in r.items()},flush=True)
# lm head
N,K=49152,576
w=torch.randn(N,K); p=torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0,16,(N,K),dtype=torch.int32),1); sz=torch.rand(K//32,N,2)
q8=torch.randint(-127,127,(N,K),dtype=torch.int8)
wb=w.bfloat16()
for M in Ms:
    x=torch.randn(M,K)
    r={'f32':bench([lambda: torch.nn.functional.linear(x,w)],10),
       'bf16':bench([lambda: torch.nn.functional.linear(x.bfloat16(),wb)],10),
       'i4bf':bench([lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(),p,32,sz.bfloat16())],10),
       'i8bf':bench([lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(),q8,sz[0,:,0].bfloat16().contiguous())],10),
       'i8f32':bench([lambda: torch.ops.aten._weight_int8pack_mm(x,q8,sz[0,:,0].contiguous())],10)}
    print('lm M',M,{k:round(v,2) for k,v in r.items()},flush=True)
