#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <chrono>
struct alignas(64) Cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) int8_t A[16*1024]; alignas(64) uint8_t B[16*1024]; alignas(64) int32_t C[8][256]; alignas(64) float D[64], S[64]; alignas(64) int32_t E[256];
double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
#define N 200000
template <int Mode>
__attribute__((target("amx-tile,amx-int8,avx512f"), noinline)) float run() {
  Cfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int t=0;t<4;t++){c.rows[t]=16; c.colsb[t]=64;} for (int t=4;t<6;t++){c.rows[t]=16; c.colsb[t]=32;} for (int t=6;t<8;t++){c.rows[t]=8; c.colsb[t]=64;}
  __asm__ volatile("ldtilecfg %0" :: "m"(c));
  __m512 acc[16]; for (int r=0;r<16;r++) acc[r]=_mm512_setzero_ps();
  const __m512 dw=_mm512_set1_ps(0.001f), mw=_mm512_set1_ps(0.002f);
  for (int i=0;i<N;i++){
    const int o=(i&7)*512;
    if (Mode & 8) {  // tile loads and products, no zeroing or stores
      _tile_loadd(6, B+o, 64); _tile_loadd(4, A+o, 32); _tile_dpbsud(0,4,6);
    }
    if (Mode & 16) {  // tile stores only
      _tile_stored(0, C[i&7], 64);
    }
    if (Mode & 1) {
      switch (i&3) {
      case 0: _tile_loadd(6, B+o, 64); _tile_loadd(4, A+o, 32); _tile_zero(0); _tile_dpbsud(0,4,6); _tile_stored(0, C[i&7], 64); break;
      case 1: _tile_loadd(7, B+o, 64); _tile_loadd(5, A+o, 32); _tile_zero(1); _tile_dpbsud(1,5,7); _tile_stored(1, C[i&7], 64); break;
      case 2: _tile_loadd(6, B+o, 64); _tile_loadd(4, A+o, 32); _tile_zero(2); _tile_dpbsud(2,4,6); _tile_stored(2, C[i&7], 64); break;
      default: _tile_loadd(7, B+o, 64); _tile_loadd(5, A+o, 32); _tile_zero(3); _tile_dpbsud(3,5,7); _tile_stored(3, C[i&7], 64); break;
      }
    }
    if (Mode & 2) {
      const int32_t* cc = (Mode & 4) ? E : C[(i + 4) & 7];
      #pragma GCC unroll 16
      for (int r=0;r<16;r++){
        __m512i isum=_mm512_load_si512((const void*)(cc+16*r));
        __m512 scale=_mm512_mul_ps(dw,_mm512_set1_ps(D[r]));
        acc[r]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),scale,acc[r]);
        acc[r]=_mm512_fmadd_ps(mw,_mm512_set1_ps(S[r]),acc[r]);
      }
    }
  }
  _tile_release();
  float s=0; for(int r=0;r<16;r++) s+=_mm512_reduce_add_ps(acc[r]); return s;
}
template<int M> void t(const char* n){ double a=now(); volatile float x=run<M>(); (void)x; printf("%-36s %6.2f ns/group\n", n, (now()-a)/N*1e9);}
int main(){ syscall(SYS_arch_prctl, 0x1023, 18);
  for (int i=0;i<64;i++){D[i]=1e-3f;S[i]=1e-3f;}
  t<1>("tiles only"); t<2>("float steps only"); t<3>("both, reading tile-stored sums"); t<7>("both, float steps read other memory"); t<6>("float only, other memory");
  t<8>("tile loads + products only"); t<14>("tile loads + products, float steps"); t<16>("tile stores only"); t<22>("tile stores, float steps");
}
