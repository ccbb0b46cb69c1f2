/* Preloaded before libfaketime for a skewed worker (tests/faults/netns.py, Nemesis.popen).
 *
 * librdkafka waits with C11's cnd_timedwait, whose deadline is on CLOCK_REALTIME. It
 * computes that deadline from the clock libfaketime fakes, but glibc's cnd_timedwait
 * calls its internal pthread_cond_timedwait directly, so libfaketime never translates
 * the deadline back to the real clock: at +30 s every timed wait lasts 30 s longer (its
 * 44 ms reconnect backoff, its metadata retries), at -30 s every one returns at once.
 * Routing cnd_timedwait through the exported pthread_cond_timedwait, which libfaketime
 * wraps and translates, fixes exactly that; glibc's cnd_t and mtx_t are a
 * pthread_cond_t and a pthread_mutex_t. */
#include <errno.h>
#include <pthread.h>
#include <threads.h>
#include <time.h>

int cnd_timedwait(cnd_t *restrict cond, mtx_t *restrict mutex,
                  const struct timespec *restrict deadline) {
    int err = pthread_cond_timedwait((pthread_cond_t *)cond, (pthread_mutex_t *)mutex, deadline);
    return err == 0 ? thrd_success : err == ETIMEDOUT ? thrd_timedout : thrd_error;
}
