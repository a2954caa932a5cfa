/* A preload for bench/collective_depth.py: every writev(2) of the process first sleeps
 * $DELAY_US microseconds, as if each message took that long to leave over a slow network.
 * gloo's TCP transport sends each message with writev, so a collective then takes about
 * (its messages in sequence on its critical path) x DELAY_US, whatever the machine's cores. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

static ssize_t (*real_writev)(int, const struct iovec *, int);

ssize_t writev(int fd, const struct iovec *iov, int count) {
  if (!real_writev) {
    real_writev = (ssize_t (*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
  }
  const char *delay = getenv("DELAY_US");
  if (delay) {
    long us = atol(delay);
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, 0);
  }
  return real_writev(fd, iov, count);
}
