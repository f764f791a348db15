/* xxh3_64 over spans for the compiler's default target (SSE2 on x86-64, NEON on arm64). */
#define HCD_ISA base
#include "_native_xxh3.h"
