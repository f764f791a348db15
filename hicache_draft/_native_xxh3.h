/* xxh3_64, compiled once per instruction set (the _native_hash_*.c files set the target, then
 * include this): XXH3 picks its vector code at compile time from __AVX2__ / __AVX512F__, so each
 * file holds the same functions built for its own target, and _native.c calls the best set the
 * CPU has. Over a list of spans at once, or streamed (reset, update, digest) as bytes arrive. */
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define HCD_CAT2(a, b) a##b
#define HCD_CAT(a, b) HCD_CAT2(a, b)

uint64_t HCD_CAT(hcd_xxh3_spans_, HCD_ISA)(const struct iovec *iov, long n) {
    if (n == 1) return XXH3_64bits(iov[0].iov_base, iov[0].iov_len);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (long k = 0; k < n; k++) XXH3_64bits_update(&st, iov[k].iov_base, iov[k].iov_len);
    return XXH3_64bits_digest(&st);
}

void HCD_CAT(hcd_xxh3_reset_, HCD_ISA)(XXH3_state_t *st) { XXH3_64bits_reset(st); }

void HCD_CAT(hcd_xxh3_update_, HCD_ISA)(XXH3_state_t *st, const void *p, size_t n) { XXH3_64bits_update(st, p, n); }

uint64_t HCD_CAT(hcd_xxh3_digest_, HCD_ISA)(const XXH3_state_t *st) { return XXH3_64bits_digest(st); }
