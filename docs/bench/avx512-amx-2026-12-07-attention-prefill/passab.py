import time, torch, sys
from stagedspec.models.loading import load_model
from stagedspec.models.quant import resolve_quant
from stagedspec.models.pass_spec import PassSpec
torch.set_num_threads(2)
model, _ = load_model("default", dtype=torch.bfloat16, device="cpu", quant=resolve_quant("auto", "default", "cpu"))
ctx=int(sys.argv[2]) if len(sys.argv)>2 else 80
cache = model.new_cache(1100)
with torch.inference_mode():
    model(torch.randint(0,49152,(1,ctx)), torch.arange(ctx), cache, PassSpec(logits_rows=slice(-1,None))); cache.commit()
    tok=torch.tensor([[5]]); pos=torch.tensor([ctx])
    def one():
        model(tok,pos,cache,PassSpec(logits_rows=slice(-1,None))); cache.discard()
    for _ in range(20): one()
    ts=[]
    for _ in range(200):
        t=time.perf_counter(); one(); ts.append(time.perf_counter()-t)
    ts.sort()
    print(sys.argv[1], "ctx", ctx, "pass ms q1 %.2f med %.2f" % (ts[50]*1e3, ts[100]*1e3))
