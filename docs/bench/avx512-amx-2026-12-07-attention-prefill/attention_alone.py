import time, torch, sys
from stagedspec.kernels.native import native_kernels
torch.set_num_threads(2)
k = native_kernels()
def bench(H, Hkv, S, D=64, T=1, dtype=torch.bfloat16, maxlen=1024, reps=300):
    g=torch.Generator().manual_seed(0)
    q=torch.randn(1,H,T,D,generator=g).to(dtype)
    kc=torch.randn(1,Hkv,maxlen,D,generator=g).to(dtype); vc=torch.randn(1,Hkv,maxlen,D,generator=g).to(dtype)
    keys=kc[:,:,:S]; vals=vc[:,:,:S]
    bias=None
    out={}
    for isa,kk in (("vec",k),):
        for _ in range(20): kk.attention(q,keys,vals,bias,D**-0.5)
        ts=[]
        for _ in range(reps):
            t=time.perf_counter(); kk.attention(q,keys,vals,bias,D**-0.5); ts.append(time.perf_counter()-t)
        ts.sort(); out[isa]=ts[len(ts)//4]
    return out
for S in (64,128,256,1024):
    r=bench(9,3,S)
    print("smollm2 S",S, {a: f"{v*1e6:.1f}us {v*1e9/(S*9):.1f}ns/key-head" for a,v in r.items()})
for S in (256,1024):
    r=bench(12,2,S,D=128)
    print("qwen S",S, {a: f"{v*1e6:.1f}us {v*1e9/(S*12):.1f}ns/key-head" for a,v in r.items()})
