/* Hand-written C declarations of HAMi-core's shared region, one per layout, from
 * docs/hami-cache-layout.md (and HAMi-core's multiprocess_memory_limit.h of each period).
 *
 * Deliberately independent of the Python ctypes declarations: tests/test_layout_offsets.py
 * compiles this with the system compiler and compares every line it prints with the offsets
 * and sizes ctypes derives. Output: one line per number, `layout key value`, e.g.
 *   v1.2 region.procs 1856
 *   v1.2 slot.seqlock 1936
 *   v1.2 sizeof.region 2008952
 */
#include <semaphore.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CUDA_DEVICE_MAX_COUNT 16
#define SHARED_REGION_MAX_PROCESS_NUM 1024

typedef char uuid_str[96];

/* ---- sub-structures ---------------------------------------------------------------- */

typedef struct {
    uint64_t context_size;
    uint64_t module_size;
    uint64_t data_size;
    uint64_t offset;
    uint64_t total;
} device_memory_v0;

typedef struct {
    uint64_t context_size;
    uint64_t module_size;
    uint64_t data_size;
    uint64_t offset;
    uint64_t total;
    uint64_t unused[3];
} device_memory_v1;

typedef struct {
    uint64_t dec_util;
    uint64_t enc_util;
    uint64_t sm_util;
} device_util_v0;

typedef struct {
    uint64_t dec_util;
    uint64_t enc_util;
    uint64_t sm_util;
    uint64_t unused[3];
} device_util_v1;

/* ---- v0a: 2024-01-24 -> 2024-04-22 ------------------------------------------------- */

typedef struct {
    int32_t pid;
    int32_t hostpid;
    device_memory_v0 used[CUDA_DEVICE_MAX_COUNT];
    uint64_t monitorused[CUDA_DEVICE_MAX_COUNT];
    int32_t status;
} slot_v0a;

typedef struct {
    int32_t initialized_flag;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    uint64_t num;
    uuid_str uuids[CUDA_DEVICE_MAX_COUNT];
    uint64_t limit[CUDA_DEVICE_MAX_COUNT];
    uint64_t sm_limit[CUDA_DEVICE_MAX_COUNT];
    slot_v0a procs[SHARED_REGION_MAX_PROCESS_NUM];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
} region_v0a;

/* ---- v0b: 2024-04-22 -> 2024-08-29 (per-process device_util) ----------------------- */

typedef struct {
    int32_t pid;
    int32_t hostpid;
    device_memory_v0 used[CUDA_DEVICE_MAX_COUNT];
    uint64_t monitorused[CUDA_DEVICE_MAX_COUNT];
    device_util_v0 device_util[CUDA_DEVICE_MAX_COUNT];
    int32_t status;
} slot_v0b;

typedef struct {
    int32_t initialized_flag;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    uint64_t num;
    uuid_str uuids[CUDA_DEVICE_MAX_COUNT];
    uint64_t limit[CUDA_DEVICE_MAX_COUNT];
    uint64_t sm_limit[CUDA_DEVICE_MAX_COUNT];
    slot_v0b procs[SHARED_REGION_MAX_PROCESS_NUM];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
} region_v0b;

/* ---- v1.1: 2024-08-29 -> 2026-03-25 ------------------------------------------------- */

typedef struct {
    int32_t pid;
    int32_t hostpid;
    device_memory_v1 used[CUDA_DEVICE_MAX_COUNT];
    uint64_t monitorused[CUDA_DEVICE_MAX_COUNT];
    device_util_v1 device_util[CUDA_DEVICE_MAX_COUNT];
    int32_t status;
    uint64_t unused[3];
} slot_v11;

typedef struct {
    int32_t initialized_flag;
    uint32_t major_version;
    uint32_t minor_version;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    uint64_t device_num;
    uuid_str uuids[CUDA_DEVICE_MAX_COUNT];
    uint64_t limit[CUDA_DEVICE_MAX_COUNT];
    uint64_t sm_limit[CUDA_DEVICE_MAX_COUNT];
    slot_v11 procs[SHARED_REGION_MAX_PROCESS_NUM];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
    uint64_t last_kernel_time;
    uint64_t unused[4];
} region_v11;

/* ---- v1.1-interim: 2026-03-25 -> 2026-04-27 (HAMi v2.8.1; still says 1.1) ----------- */

typedef struct {
    int32_t pid;
    int32_t hostpid;
    uint64_t seqlock;
    device_memory_v1 used[CUDA_DEVICE_MAX_COUNT];
    uint64_t monitorused[CUDA_DEVICE_MAX_COUNT];
    device_util_v1 device_util[CUDA_DEVICE_MAX_COUNT];
    int32_t status;
    uint64_t unused[2];
} slot_v11_interim;

typedef struct {
    int32_t initialized_flag;
    uint32_t major_version;
    uint32_t minor_version;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    sem_t sem_postinit;
    uint64_t device_num;
    uuid_str uuids[CUDA_DEVICE_MAX_COUNT];
    uint64_t limit[CUDA_DEVICE_MAX_COUNT];
    uint64_t sm_limit[CUDA_DEVICE_MAX_COUNT];
    slot_v11_interim procs[SHARED_REGION_MAX_PROCESS_NUM];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
    uint64_t last_kernel_time;
    uint64_t unused[4];
} region_v11_interim;

/* ---- v1.2: 2026-04-27 -> now (seqlock and sem_postinit moved into reserved words) --- */

typedef struct {
    int32_t pid;
    int32_t hostpid;
    device_memory_v1 used[CUDA_DEVICE_MAX_COUNT];
    uint64_t monitorused[CUDA_DEVICE_MAX_COUNT];
    device_util_v1 device_util[CUDA_DEVICE_MAX_COUNT];
    int32_t status;
    uint64_t seqlock;
    uint64_t unused[2];
} slot_v12;

typedef struct {
    int32_t initialized_flag;
    uint32_t major_version;
    uint32_t minor_version;
    int32_t sm_init_flag;
    size_t owner_pid;
    sem_t sem;
    uint64_t device_num;
    uuid_str uuids[CUDA_DEVICE_MAX_COUNT];
    uint64_t limit[CUDA_DEVICE_MAX_COUNT];
    uint64_t sm_limit[CUDA_DEVICE_MAX_COUNT];
    slot_v12 procs[SHARED_REGION_MAX_PROCESS_NUM];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
    uint64_t last_kernel_time;
    sem_t sem_postinit;
} region_v12;

/* ---- printing ----------------------------------------------------------------------- */

#define OFF(lay, type, part, field) \
    printf("%s %s.%s %zu\n", lay, part, #field, offsetof(type, field))
#define SIZE(lay, type, part) \
    printf("%s sizeof.%s %zu\n%s alignof.%s %zu\n", lay, part, sizeof(type), lay, part, \
           _Alignof(type))

#define DM_V0(lay)                                   \
    OFF(lay, device_memory_v0, "dm", context_size);  \
    OFF(lay, device_memory_v0, "dm", module_size);   \
    OFF(lay, device_memory_v0, "dm", data_size);     \
    OFF(lay, device_memory_v0, "dm", offset);        \
    OFF(lay, device_memory_v0, "dm", total);         \
    SIZE(lay, device_memory_v0, "dm")

#define DM_V1(lay)                                   \
    OFF(lay, device_memory_v1, "dm", context_size);  \
    OFF(lay, device_memory_v1, "dm", module_size);   \
    OFF(lay, device_memory_v1, "dm", data_size);     \
    OFF(lay, device_memory_v1, "dm", offset);        \
    OFF(lay, device_memory_v1, "dm", total);         \
    OFF(lay, device_memory_v1, "dm", unused);        \
    SIZE(lay, device_memory_v1, "dm")

#define DU_V0(lay)                                \
    OFF(lay, device_util_v0, "du", dec_util);     \
    OFF(lay, device_util_v0, "du", enc_util);     \
    OFF(lay, device_util_v0, "du", sm_util);      \
    SIZE(lay, device_util_v0, "du")

#define DU_V1(lay)                                \
    OFF(lay, device_util_v1, "du", dec_util);     \
    OFF(lay, device_util_v1, "du", enc_util);     \
    OFF(lay, device_util_v1, "du", sm_util);      \
    OFF(lay, device_util_v1, "du", unused);       \
    SIZE(lay, device_util_v1, "du")

/* Header fields shared by the v0 layouts. */
#define REGION_V0(lay, type)                        \
    OFF(lay, type, "region", initialized_flag);     \
    OFF(lay, type, "region", sm_init_flag);         \
    OFF(lay, type, "region", owner_pid);            \
    OFF(lay, type, "region", sem);                  \
    OFF(lay, type, "region", num);                  \
    OFF(lay, type, "region", uuids);                \
    OFF(lay, type, "region", limit);                \
    OFF(lay, type, "region", sm_limit);             \
    OFF(lay, type, "region", procs);                \
    OFF(lay, type, "region", proc_num);             \
    OFF(lay, type, "region", utilization_switch);   \
    OFF(lay, type, "region", recent_kernel);        \
    OFF(lay, type, "region", priority);             \
    SIZE(lay, type, "region")

#define REGION_V1_HEAD(lay, type)                   \
    OFF(lay, type, "region", initialized_flag);     \
    OFF(lay, type, "region", major_version);        \
    OFF(lay, type, "region", minor_version);        \
    OFF(lay, type, "region", sm_init_flag);         \
    OFF(lay, type, "region", owner_pid);            \
    OFF(lay, type, "region", sem);                  \
    OFF(lay, type, "region", device_num);           \
    OFF(lay, type, "region", uuids);                \
    OFF(lay, type, "region", limit);                \
    OFF(lay, type, "region", sm_limit);             \
    OFF(lay, type, "region", procs);                \
    OFF(lay, type, "region", proc_num);             \
    OFF(lay, type, "region", utilization_switch);   \
    OFF(lay, type, "region", recent_kernel);        \
    OFF(lay, type, "region", priority);             \
    OFF(lay, type, "region", last_kernel_time);     \
    SIZE(lay, type, "region")

int main(void) {
    printf("all sizeof.sem %zu\nall alignof.sem %zu\n", sizeof(sem_t), _Alignof(sem_t));

    REGION_V0("v0a", region_v0a);
    OFF("v0a", slot_v0a, "slot", pid);
    OFF("v0a", slot_v0a, "slot", hostpid);
    OFF("v0a", slot_v0a, "slot", used);
    OFF("v0a", slot_v0a, "slot", monitorused);
    OFF("v0a", slot_v0a, "slot", status);
    SIZE("v0a", slot_v0a, "slot");
    DM_V0("v0a");

    REGION_V0("v0b", region_v0b);
    OFF("v0b", slot_v0b, "slot", pid);
    OFF("v0b", slot_v0b, "slot", hostpid);
    OFF("v0b", slot_v0b, "slot", used);
    OFF("v0b", slot_v0b, "slot", monitorused);
    OFF("v0b", slot_v0b, "slot", device_util);
    OFF("v0b", slot_v0b, "slot", status);
    SIZE("v0b", slot_v0b, "slot");
    DM_V0("v0b");
    DU_V0("v0b");

    REGION_V1_HEAD("v1.1", region_v11);
    OFF("v1.1", region_v11, "region", unused);
    OFF("v1.1", slot_v11, "slot", pid);
    OFF("v1.1", slot_v11, "slot", hostpid);
    OFF("v1.1", slot_v11, "slot", used);
    OFF("v1.1", slot_v11, "slot", monitorused);
    OFF("v1.1", slot_v11, "slot", device_util);
    OFF("v1.1", slot_v11, "slot", status);
    OFF("v1.1", slot_v11, "slot", unused);
    SIZE("v1.1", slot_v11, "slot");
    DM_V1("v1.1");
    DU_V1("v1.1");

    REGION_V1_HEAD("v1.1-interim", region_v11_interim);
    OFF("v1.1-interim", region_v11_interim, "region", sem_postinit);
    OFF("v1.1-interim", region_v11_interim, "region", unused);
    OFF("v1.1-interim", slot_v11_interim, "slot", pid);
    OFF("v1.1-interim", slot_v11_interim, "slot", hostpid);
    OFF("v1.1-interim", slot_v11_interim, "slot", seqlock);
    OFF("v1.1-interim", slot_v11_interim, "slot", used);
    OFF("v1.1-interim", slot_v11_interim, "slot", monitorused);
    OFF("v1.1-interim", slot_v11_interim, "slot", device_util);
    OFF("v1.1-interim", slot_v11_interim, "slot", status);
    OFF("v1.1-interim", slot_v11_interim, "slot", unused);
    SIZE("v1.1-interim", slot_v11_interim, "slot");
    DM_V1("v1.1-interim");
    DU_V1("v1.1-interim");

    REGION_V1_HEAD("v1.2", region_v12);
    OFF("v1.2", region_v12, "region", sem_postinit);
    OFF("v1.2", slot_v12, "slot", pid);
    OFF("v1.2", slot_v12, "slot", hostpid);
    OFF("v1.2", slot_v12, "slot", used);
    OFF("v1.2", slot_v12, "slot", monitorused);
    OFF("v1.2", slot_v12, "slot", device_util);
    OFF("v1.2", slot_v12, "slot", status);
    OFF("v1.2", slot_v12, "slot", seqlock);
    OFF("v1.2", slot_v12, "slot", unused);
    SIZE("v1.2", slot_v12, "slot");
    DM_V1("v1.2");
    DU_V1("v1.2");
    return 0;
}
