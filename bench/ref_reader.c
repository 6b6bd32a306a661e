/* A compiled, unchecked reference reader of a v1.2 cache file, for bench_snapshot.py.
 *
 * What HAMi's own monitor does: mmap the region, cast it to the struct, copy out every metric
 * (device uuids, limits, each live slot's counters, monitorused, sm_util), unmap. No seqlock,
 * no bounds checks, no validation: the floor a consistent reader is compared with.
 *
 *   ref_reader FILE CALLS   ->  two lines: `cold NS` (open + mmap + read + munmap + close per
 *                               call) and `mapped NS` (the metrics of a region mapped once),
 *                               each the median over CALLS calls, in nanoseconds.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 16
#define MAX_PROCS 1024

typedef struct {
    uint64_t context_size, module_size, data_size, offset, total, unused[3];
} device_memory;

typedef struct {
    uint64_t dec_util, enc_util, sm_util, unused[3];
} device_util;

typedef struct {
    int32_t pid;
    int32_t hostpid;
    device_memory used[MAX_DEVICES];
    uint64_t monitorused[MAX_DEVICES];
    device_util device_util[MAX_DEVICES];
    int32_t status;
    uint64_t seqlock;
    uint64_t unused[2];
} slot;

typedef struct {
    int32_t initialized_flag;
    uint32_t major_version, minor_version;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    uint64_t device_num;
    char uuids[MAX_DEVICES][96];
    uint64_t limit[MAX_DEVICES];
    uint64_t sm_limit[MAX_DEVICES];
    slot procs[MAX_PROCS];
    int32_t proc_num, utilization_switch, recent_kernel, priority;
} region;

typedef struct {
    int32_t pid, hostpid, status;
    uint64_t context[MAX_DEVICES], module[MAX_DEVICES], data[MAX_DEVICES], total[MAX_DEVICES];
    uint64_t monitor[MAX_DEVICES], sm_util[MAX_DEVICES];
} proc_out;

typedef struct {
    uint64_t device_num;
    char uuids[MAX_DEVICES][96];
    uint64_t limit[MAX_DEVICES], sm_limit[MAX_DEVICES];
    int32_t proc_num;
    proc_out procs[MAX_PROCS];
} snapshot;

static snapshot out;

static void read_metrics(const region *r) {
    uint64_t n = r->device_num < MAX_DEVICES ? r->device_num : MAX_DEVICES;
    out.device_num = n;
    memcpy(out.uuids, r->uuids, n * 96);
    memcpy(out.limit, r->limit, n * 8);
    memcpy(out.sm_limit, r->sm_limit, n * 8);
    int32_t procs = r->proc_num;
    if (procs < 0 || procs > MAX_PROCS) procs = 0;
    out.proc_num = procs;
    for (int32_t k = 0; k < procs; k++) {
        const slot *s = &r->procs[k];
        proc_out *p = &out.procs[k];
        p->pid = s->pid;
        p->hostpid = s->hostpid;
        p->status = s->status;
        for (uint64_t d = 0; d < n; d++) {
            p->context[d] = s->used[d].context_size;
            p->module[d] = s->used[d].module_size;
            p->data[d] = s->used[d].data_size;
            p->total[d] = s->used[d].total;
            p->monitor[d] = s->monitorused[d];
            p->sm_util[d] = s->device_util[d].sm_util;
        }
    }
    __asm__ __volatile__("" : : "g"(&out) : "memory"); /* keep the copies */
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int64_t median(int64_t *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: ref_reader FILE CALLS\n");
        return 2;
    }
    const char *path = argv[1];
    int calls = atoi(argv[2]);
    if (calls < 1) calls = 1;
    int64_t *t = malloc(sizeof(int64_t) * (size_t)calls);
    if (t == NULL) return 1;
    for (int i = 0; i < calls; i++) {
        int64_t t0 = now_ns();
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return 1;
        void *m = mmap(NULL, sizeof(region), PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) return 1;
        read_metrics((const region *)m);
        munmap(m, sizeof(region));
        close(fd);
        t[i] = now_ns() - t0;
    }
    printf("cold %lld\n", (long long)median(t, calls));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    void *m = mmap(NULL, sizeof(region), PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return 1;
    for (int i = 0; i < calls; i++) {
        int64_t t0 = now_ns();
        read_metrics((const region *)m);
        t[i] = now_ns() - t0;
    }
    printf("mapped %lld\n", (long long)median(t, calls));
    munmap(m, sizeof(region));
    close(fd);
    free(t);
    return 0;
}
