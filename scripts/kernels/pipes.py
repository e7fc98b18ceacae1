"""Which instructions share execution ports with 512-bit `vpdpbusd` on this CPU: the limit on the VNNI tiles.

    python scripts/kernels/pipes.py

A tile's inner loop is `vpdpbusd` (8 per row, group of 32 inputs and 16 outputs) plus, per row and group, the
float steps of the exactness contract (docs/kernels.md): one `vmulps` and two `vfmadd` for int4 / Q4_K / Q5_0,
an int -> float conversion and activation broadcasts.  Here each is timed beside 16 independent `vpdpbusd`
chains, in straight-line inline assembly (no compiler choices): where an instruction adds time, it takes a port
`vpdpbusd` needs, and the tiles can reach at most 8 / (8 + such instructions) of the `vpdpbusd` floor.  Needs g++
and AVX-512 VNNI; takes a few seconds.  Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

# name: (vpdpbusd, vfmadd, vmulps, vcvtdq2ps, broadcast source: 0 register, 1 embedded, 2 vpbroadcastd load)
MIXES = {
    "16 vpdpbusd": (16, 0, 0, 0, 0),
    "+ 4 vfmadd231ps": (16, 4, 0, 0, 0),
    "+ 8 vfmadd231ps": (16, 8, 0, 0, 0),
    "+ 4 vmulps": (16, 0, 4, 0, 0),
    "+ 8 vcvtdq2ps": (16, 0, 0, 8, 0),
    "activations as {1to16} operands": (16, 0, 0, 0, 1),
    "activations by vpbroadcastd loads": (16, 0, 0, 0, 2),
}


def body(dp: int, fma: int, mul: int, cvt: int, bcast: int) -> str:
    lines = []
    for i in range(dp):
        if bcast == 1:
            lines.append(f"vpdpbusd {4 * (i % 8)}(%[m])%{{1to16}}, %%zmm2, %%zmm{8 + i}")
        elif bcast == 2:
            lines += [f"vpbroadcastd {4 * (i % 8)}(%[m]), %%zmm{30 + i % 2}", f"vpdpbusd %%zmm{30 + i % 2}, %%zmm2, %%zmm{8 + i}"]
        else:
            lines.append(f"vpdpbusd %%zmm1, %%zmm2, %%zmm{8 + i}")
    lines += [f"vfmadd231ps %%zmm3, %%zmm4, %%zmm{24 + i}" for i in range(fma)]
    lines += ["vmulps %%zmm3, %%zmm4, %%zmm5" for _ in range(mul)]
    lines += [f"vcvtdq2ps %%zmm{8 + i}, %%zmm6" for i in range(cvt)]
    return "\\n".join(lines)


def source() -> str:
    clobbers = ", ".join(f'"xmm{i}"' for i in range(1, 32) if i != 7)
    out = ["#include <chrono>\n#include <cstdio>\n#include <cstdint>\nint32_t mem[16] = {1, 2, 3, 4, 5, 6, 7, 8};\n"]
    for k, mix in enumerate(MIXES.values()):
        out.append(f"double run{k}(long n) {{ auto t0 = std::chrono::steady_clock::now();\n"
                   f"  for (long i = 0; i < n; ++i) asm volatile(\"{body(*mix)}\" :: [m] \"r\"(mem) : \"memory\", {clobbers});\n"
                   "  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n * 1e9; }\n")
    out.append("int main() { const long n = 50000000;\n")
    for k, name in enumerate(MIXES):
        out.append(f'  {{ double best = 1e9; for (int r = 0; r < 3; ++r) {{ double t = run{k}(n); if (t < best) best = t; }}\n'
                   f'    printf("%s\\t%.3f\\n", "{name}", best); }}\n')
    out.append("}\n")
    return "".join(out)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = pathlib.Path(tmp) / "pipes.cpp", pathlib.Path(tmp) / "pipes"
        src.write_text(source())
        subprocess.run(["g++", "-O2", "-mavx512f", "-mavx512vnni", "-o", str(exe), str(src)], check=True)
        rows = [line.split("\t") for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                             check=True).stdout.splitlines()]
    base = float(rows[0][1])
    print("mix | ns per iteration | extra, in vpdpbusd slots")
    for name, ns in rows:
        print(f"{name} | {float(ns):.3f} | {(float(ns) - base) / (base / 16):+.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
