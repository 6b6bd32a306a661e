/* A HAMi-core-style seqlock writer hammering one process slot of a cache file.
 *
 * Usage: seqlock_writer PATH SLOT_OFF SEQ_OFF USED_OFF USED_STRIDE CTX_OFF DATA_OFF TOTAL_OFF
 *                       NDEV SECONDS PAUSE_NS
 *
 * Every offset comes from the caller (tests/test_seqlock_concurrency.py derives them from the
 * Python ctypes declarations), so no layout number is written down twice. SLOT_OFF is the
 * absolute offset of the slot, SEQ_OFF/USED_OFF are inside the slot, USED_STRIDE is
 * sizeof(device_memory_t), CTX/DATA/TOTAL_OFF are inside device_memory_t.
 *
 * The file is mapped MAP_SHARED, as libvgpu.so maps it. For device d = 0..NDEV-1, in a loop
 * until SECONDS have passed:
 *     seqlock += 1 (odd)      -- full barrier: no later store moves above it
 *     data_size = new value;  total = context_size + data_size
 *     seqlock += 1 (even)     -- release: the stores above are visible first
 * context_size is fixed per device, data_size changes every iteration, so any read that mixes
 * two updates sees total != context + data. PAUSE_NS > 0 spins that long between updates
 * (0: a tight loop). Prints "ready" once mapped, then "updates N" at the end.
 *
 * SIGTERM stops it between two brackets, never inside one: a writer killed mid-update would
 * leave the seqlock odd for good, and the next writer would then run with the parity inverted
 * (odd = idle, even = writing). It refuses to start on an odd seqlock for the same reason.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t arg(char **argv, int i) { return (size_t)strtoull(argv[i], NULL, 0); }

static volatile sig_atomic_t stop = 0;

static void on_term(int sig) {
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv) {
    if (argc != 12) {
        fprintf(stderr,
                "usage: %s PATH SLOT_OFF SEQ_OFF USED_OFF USED_STRIDE CTX_OFF DATA_OFF "
                "TOTAL_OFF NDEV SECONDS PAUSE_NS\n",
                argv[0]);
        return 2;
    }
    size_t slot = arg(argv, 2), seq_off = arg(argv, 3), used = arg(argv, 4);
    size_t stride = arg(argv, 5), ctx_off = arg(argv, 6), data_off = arg(argv, 7);
    size_t total_off = arg(argv, 8), ndev = arg(argv, 9);
    double seconds = strtod(argv[10], NULL);
    uint64_t pause_ns = strtoull(argv[11], NULL, 0);

    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        perror("open");
        return 1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        perror("fstat");
        return 1;
    }
    unsigned char *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    close(fd);

    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGTERM, &sa, NULL) != 0) {
        perror("sigaction");
        return 1;
    }

    uint64_t *seq = (uint64_t *)(base + slot + seq_off);
    if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) & 1) {
        fprintf(stderr, "seqlock is odd (%llu): a writer died inside a bracket\n",
                (unsigned long long)*seq);
        return 1;
    }
    volatile uint64_t *ctx[64], *data[64], *total[64];
    if (ndev > 64) ndev = 64;
    for (size_t d = 0; d < ndev; d++) {
        unsigned char *dm = base + slot + used + d * stride;
        ctx[d] = (volatile uint64_t *)(dm + ctx_off);
        data[d] = (volatile uint64_t *)(dm + data_off);
        total[d] = (volatile uint64_t *)(dm + total_off);
        __atomic_fetch_add(seq, 1, __ATOMIC_SEQ_CST);
        *ctx[d] = (uint64_t)(d + 1) << 20;
        *data[d] = 0;
        *total[d] = *ctx[d];
        __atomic_fetch_add(seq, 1, __ATOMIC_RELEASE);
    }
    printf("ready\n");
    fflush(stdout);

    uint64_t deadline = now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t updates = 0;
    for (uint64_t i = 1;; i++) {
        for (size_t d = 0; d < ndev; d++) {
            /* a value that differs from the last one in many bytes */
            uint64_t value = (i * 0x9E3779B97F4A7C15ull + d) >> 16;
            __atomic_fetch_add(seq, 1, __ATOMIC_SEQ_CST); /* odd */
            *data[d] = value;
            *total[d] = *ctx[d] + value;
            __atomic_fetch_add(seq, 1, __ATOMIC_RELEASE); /* even */
            updates++;
            if (pause_ns) {
                uint64_t until = now_ns() + pause_ns;
                while (now_ns() < until) {
                }
            }
        }
        if (stop || ((i & 1023) == 0 && now_ns() >= deadline)) break;
    }
    printf("updates %llu seqlock %llu\n", (unsigned long long)updates,
           (unsigned long long)__atomic_load_n(seq, __ATOMIC_ACQUIRE));
    munmap(base, (size_t)st.st_size);
    return 0;
}
