/* hicache_draft._native: a team of plain threads for one call's independent pieces of work
 * (_native_team.c).
 *
 * hcd_team_run(work, ctx, n, threads) runs work(ctx, i) for every i in [0, n) on the calling thread
 * and up to threads - 1 helpers, each taking the next undone i as it gets free, and returns once
 * every i is done and no helper will touch ctx again. The helpers are pthreads that never call
 * into Python, so they start together (not one after another through the GIL, as Python threads
 * do) and a helper that wakes late simply takes fewer pieces. Call it with the GIL released. */
#ifndef HCD_NATIVE_TEAM_H
#define HCD_NATIVE_TEAM_H

#include <stddef.h>

typedef void (*hcd_work)(void *ctx, ptrdiff_t i);

void hcd_team_run(hcd_work work, void *ctx, ptrdiff_t n, int threads);
/* The same, but the calling thread first runs first(first_ctx) once the helpers are woken (its own
 * work that needs none of the pieces), then takes whatever piece is left; up to n helpers join. */
void hcd_team_run_first(hcd_work work, void *ctx, ptrdiff_t n, int threads, void (*first)(void *), void *first_ctx);
/* Helpers that have taken part in a team since the module loaded (tests, benchmarks). */
long long hcd_team_helped(void);
/* How long (ns) a helper that finished a piece stays awake for the next team (0: it sleeps at once). */
void hcd_team_spin(long long ns);
long long hcd_team_spin_ns(void);
/* A team of up to `threads` is about to be posted: wake up to threads - 1 sleeping helpers now; they
 * stay awake (bounded) until it is posted or hcd_team_unexpect. Every expect needs one unexpect. */
void hcd_team_expect(int threads);
void hcd_team_unexpect(void);
/* Expectations not yet ended (tests). */
int hcd_team_expecting(void);

#endif
