/* xxh3_64 over spans built for AVX2 (see _native_xxh3.h); nothing on other processors. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define HCD_ISA avx2
#include "_native_xxh3.h"
#endif
