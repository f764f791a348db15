/* hicache_draft._native: a team of plain threads for one call's independent pieces of work
 * (see _native_team.h).
 *
 * Why (issue 15, measured on the H200 host): a page_get shared by Python threads starts them one
 * after another, since each must take the GIL to begin and each hand-over wakes a sleeping
 * thread: 16 threads reading 32 pages of 8 MiB began over 1.2 ms, 11 threads reading 64 pages of
 * 1 MiB over 1.4 ms of a 3 ms call. Helpers here wait on one condition variable and are woken
 * together; they take pieces from a shared counter, so the calling thread starts at once and the
 * work spreads over whoever is running.
 *
 * Helpers are started on first need, up to MAX_HELPERS, and then wait for the next team. Several
 * teams (calls from several threads) may be posted at once; a helper serves the oldest that still
 * has undone pieces and room for one more helper. A team's owner takes it down (no helper joins
 * any more) and then waits for the helpers inside it to finish their current piece, so ctx, which
 * lives on the owner's stack, is never touched after hcd_team_run returns. After fork() the child
 * starts with no helper (the parent's threads do not exist there).
 *
 * Waking a sleeping thread takes tens of microseconds (more on a VM), so a helper that finished a
 * piece stays awake for hcd_team_spin nanoseconds watching for the next team before it sleeps, and
 * a caller about to post a team (a Store call whose backend will hand the core its runs) wakes
 * helpers ahead with hcd_team_expect: they stay awake while it expects, at most EXPECT_MAX_NS, so
 * they are running when the team is posted, not woken then. Measured on the 2-core VM, 128 x 64 KiB
 * verified page_get: 6.8 -> 8.3 GB/s. An awake helper yields its CPU every few microseconds (a
 * thread that wants it runs; with none, sched_yield returns at once): one that only spun took half
 * of a busy CPU from the threads beside it, Mooncake's shared-memory client among them (its gets
 * 15% slower on the VM). */
#define _GNU_SOURCE
#include "_native_team.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_HELPERS 64
#define EXPECT_MAX_NS 2000000LL /* the longest a prewoken helper stays awake for an expected team */

typedef struct team team;
struct team {
    hcd_work work;
    void *ctx;
    ptrdiff_t n;
    _Atomic ptrdiff_t next; /* the next piece nobody took */
    int room;               /* under mu: helpers it may still take */
    int inside;             /* under mu: helpers working on it */
    int posted;             /* under mu: helpers may join */
    pthread_cond_t left;    /* the owner waits here for inside == 0 */
    team *link;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static team *teams; /* posted, oldest first */
static int helpers, idle, forking_ready;
static int spinning; /* under mu: helpers awake without the lock, watching `posts` */
static long long helped;
static _Atomic unsigned long long posts; /* teams posted so far */
static _Atomic long long spin_ns;        /* how long a helper that worked stays awake for the next team */
static _Atomic int expecting;            /* callers about to post a team (hcd_team_expect) */

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Called with mu held; returns with it held. Stay awake without the lock until a team is posted or,
 * for a helper that worked (`worked`), spin_ns passed, or, for one woken ahead, nobody expects a
 * team any more or EXPECT_MAX_NS passed. */
static void stay_awake(int worked) {
    long long ns = worked ? atomic_load(&spin_ns) : EXPECT_MAX_NS;
    if (ns <= 0) return;
    unsigned long long seen = atomic_load(&posts);
    spinning++;
    pthread_mutex_unlock(&mu);
    long long end = now_ns() + ns;
    for (unsigned k = 1; atomic_load(&posts) == seen; k++) {
        relax();
        if (!(k & 63)) {
            if ((!worked && atomic_load(&expecting) <= 0) || now_ns() >= end) break;
            sched_yield(); /* awake, but never holding a core that another runnable thread wants */
        }
    }
    pthread_mutex_lock(&mu);
    spinning--;
}

static void prepare(void) { pthread_mutex_lock(&mu); }
static void parent(void) { pthread_mutex_unlock(&mu); }
static void child(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&wake, NULL);
    teams = NULL;
    helpers = idle = spinning = 0;
    atomic_store(&expecting, 0);
}

static void take_all(team *t) {
    for (;;) {
        ptrdiff_t i = atomic_fetch_add(&t->next, 1);
        if (i >= t->n) return;
        t->work(t->ctx, i);
    }
}

static void *helper(void *unused) {
    (void)unused;
    pthread_setname_np(pthread_self(), "hcd-team"); /* as top -H and /proc/<pid>/task/<tid>/comm show it */
    enum { ASLEEP, WORKED, WOKEN } was = ASLEEP; /* what this helper did last */
    pthread_mutex_lock(&mu);
    for (;;) {
        team *t = teams;
        while (t != NULL && (t->room == 0 || atomic_load(&t->next) >= t->n)) t = t->link;
        if (t == NULL) {
            if (was == WORKED || (was == WOKEN && atomic_load(&expecting) > 0)) {
                stay_awake(was == WORKED);
                was = ASLEEP; /* once: found nothing after that, it sleeps */
                continue;
            }
            idle++;
            pthread_cond_wait(&wake, &mu);
            idle--;
            was = WOKEN;
            continue;
        }
        t->room--;
        t->inside++;
        helped++;
        pthread_mutex_unlock(&mu);
        take_all(t);
        pthread_mutex_lock(&mu);
        if (--t->inside == 0 && !t->posted) pthread_cond_signal(&t->left);
        was = WORKED;
    }
    return NULL;
}

void hcd_team_run(hcd_work work, void *ctx, ptrdiff_t n, int threads) { hcd_team_run_first(work, ctx, n, threads, NULL, NULL); }

void hcd_team_run_first(hcd_work work, void *ctx, ptrdiff_t n, int threads, void (*first)(void *), void *first_ctx) {
    /* the helpers the team may take: every piece when the owner is busy first, else all but one */
    ptrdiff_t want = first != NULL ? n : n - 1;
    if (want < 1 || threads <= 1) {
        if (first != NULL) first(first_ctx);
        for (ptrdiff_t i = 0; i < n; i++) work(ctx, i);
        return;
    }
    team t = {.work = work, .ctx = ctx, .n = n, .room = (int)(threads - 1 < want ? threads - 1 : want)};
    atomic_init(&t.next, 0);
    pthread_cond_init(&t.left, NULL);
    pthread_mutex_lock(&mu);
    if (!forking_ready) {
        pthread_atfork(prepare, parent, child);
        forking_ready = 1;
    }
    t.posted = 1;
    team **end = &teams;
    while (*end != NULL) end = &(*end)->link;
    *end = &t;
    atomic_fetch_add(&posts, 1);
    if (t.room > idle + spinning && helpers < MAX_HELPERS) {
        /* helpers block every signal (inherited from here): signals go to the process's own threads,
         * where Python handles them, and a helper's preadv is never interrupted */
        sigset_t all, before;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &before);
        for (int more = t.room - idle - spinning; more > 0 && helpers < MAX_HELPERS; more--) {
            pthread_t id;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 256 << 10);
            if (pthread_create(&id, &attr, helper, NULL) == 0) helpers++;
            pthread_attr_destroy(&attr);
        }
        pthread_sigmask(SIG_SETMASK, &before, NULL);
    }
    if (idle > 0) pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    if (first != NULL) first(first_ctx); /* while the helpers start on the pieces */
    take_all(&t); /* the owner works too: with no helper at all, it does every piece */
    pthread_mutex_lock(&mu);
    t.posted = 0;
    for (team **at = &teams; *at != NULL; at = &(*at)->link) {
        if (*at == &t) {
            *at = t.link;
            break;
        }
    }
    while (t.inside > 0) pthread_cond_wait(&t.left, &mu);
    pthread_mutex_unlock(&mu);
    pthread_cond_destroy(&t.left);
}

long long hcd_team_helped(void) {
    pthread_mutex_lock(&mu);
    long long n = helped;
    pthread_mutex_unlock(&mu);
    return n;
}

void hcd_team_spin(long long ns) { atomic_store(&spin_ns, ns < 0 ? 0 : ns); }

long long hcd_team_spin_ns(void) { return atomic_load(&spin_ns); }

void hcd_team_expect(int threads) {
    atomic_fetch_add(&expecting, 1);
    if (threads <= 1) return;
    pthread_mutex_lock(&mu);
    for (int k = 0; k < threads - 1 && k < idle; k++) pthread_cond_signal(&wake);
    pthread_mutex_unlock(&mu);
}

void hcd_team_unexpect(void) { atomic_fetch_sub(&expecting, 1); }

int hcd_team_expecting(void) { return atomic_load(&expecting); }
