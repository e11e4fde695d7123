/*
 * A stand-in for libnvidia-ml.so.1 on machines without an NVIDIA GPU.
 *
 * It implements the few NVML calls pdwatch's GPU sampler makes through the
 * unmodified nvidia-ml-py, with every value read from a plain-text state file
 * named by PDWATCH_NVML_STUB_STATE (format in nvml_stub/README.md). The file is
 * re-read whenever its path, inode, size or mtime changes, so a writer that
 * replaces it atomically (tmp + rename) is seen on the next call.
 *
 * Error codes and struct layouts follow NVML's public header; names of the
 * exported symbols are the ones nvidia-ml-py looks up (versioned where it
 * asks for a versioned one).
 */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_UNKNOWN = 999,
};

/* Layouts as in nvml.h. */
typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t; /* also _v3: nvidia-ml-py uses one struct for both */

#define MAX_DEVICES 64
#define MAX_PIDS 64
#define TEXT_LEN 96

/* The queries a state file can make fail one by one (`fail <query> <code>`). */
enum query {
    Q_HANDLE, Q_UUID, Q_NAME, Q_UTILIZATION, Q_POWER, Q_POWER_LIMIT,
    Q_MEMORY, Q_PROCESSES, Q_COUNT
};
static const char *const query_names[Q_COUNT] = {
    "handle", "uuid", "name", "utilization", "power", "power_limit",
    "memory", "processes",
};

struct device {
    char uuid[TEXT_LEN];
    char name[TEXT_LEN];
    unsigned int util_gpu, util_memory;
    unsigned int power_mw, power_limit_mw;
    unsigned long long memory_total, memory_used;
    unsigned int pids[MAX_PIDS];
    unsigned int pid_count;
    unsigned int delay_ms;          /* every query of this device first sleeps this long */
    nvmlReturn_t error;             /* every query of this device fails with it */
    nvmlReturn_t fail[Q_COUNT];     /* one query fails with it */
};

struct state {
    int loaded;                     /* the file was read */
    nvmlReturn_t init_error;
    nvmlReturn_t count_error;
    char driver[TEXT_LEN];
    struct device devices[MAX_DEVICES];
    unsigned int count;
};

/* An opaque handle is the address of one of these: the device index is its
 * position, so handles stay valid forever and are never written. */
struct handle_slot { char unused; };
static struct handle_slot handle_slots[MAX_DEVICES];

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct state current;
static int init_refcount;
/* What identified the file last read, to skip re-reading an unchanged one. */
static char seen_path[PATH_MAX];
static struct stat seen_stat;

static const struct { const char *name; nvmlReturn_t code; } error_names[] = {
    {"SUCCESS", NVML_SUCCESS},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"IN_USE", NVML_ERROR_IN_USE},
    {"MEMORY", NVML_ERROR_MEMORY},
    {"NO_DATA", NVML_ERROR_NO_DATA},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

/* An error given by name (GPU_IS_LOST) or number (15); unknown text is UNKNOWN. */
static nvmlReturn_t parse_error(const char *text)
{
    char *end;
    long n = strtol(text, &end, 10);
    if (end != text && *end == '\0')
        return (nvmlReturn_t)n;
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++)
        if (strcmp(text, error_names[i].name) == 0)
            return error_names[i].code;
    return NVML_ERROR_UNKNOWN;
}

static void copy_text(char *dst, const char *src)
{
    snprintf(dst, TEXT_LEN, "%s", src);
}

static void parse_pids(struct device *d, char *value)
{
    d->pid_count = 0;
    for (char *tok = strtok(value, " \t"); tok && d->pid_count < MAX_PIDS;
         tok = strtok(NULL, " \t"))
        d->pids[d->pid_count++] = (unsigned int)strtoul(tok, NULL, 10);
}

/* One `key value` line; `device` opens the next device, the rest apply to it. */
static void parse_line(struct state *s, char *line)
{
    char *key = line;
    while (*key == ' ' || *key == '\t')
        key++;
    if (*key == '#' || *key == '\0')
        return;
    char *value = key + strcspn(key, " \t");
    if (*value) {
        *value++ = '\0';
        value += strspn(value, " \t");
    }

    if (strcmp(key, "driver") == 0) { copy_text(s->driver, value); return; }
    if (strcmp(key, "init_error") == 0) { s->init_error = parse_error(value); return; }
    if (strcmp(key, "count_error") == 0) { s->count_error = parse_error(value); return; }
    if (strcmp(key, "device") == 0) {
        if (s->count < MAX_DEVICES)
            s->count++;
        return;
    }
    if (s->count == 0)
        return; /* a device key before any `device` line: ignored */
    struct device *d = &s->devices[s->count - 1];
    if (strcmp(key, "uuid") == 0) copy_text(d->uuid, value);
    else if (strcmp(key, "name") == 0) copy_text(d->name, value);
    else if (strcmp(key, "utilization_gpu") == 0) d->util_gpu = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "utilization_memory") == 0) d->util_memory = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "power_mw") == 0) d->power_mw = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "power_limit_mw") == 0) d->power_limit_mw = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "memory_total") == 0) d->memory_total = strtoull(value, NULL, 10);
    else if (strcmp(key, "memory_used") == 0) d->memory_used = strtoull(value, NULL, 10);
    else if (strcmp(key, "pids") == 0) parse_pids(d, value);
    else if (strcmp(key, "delay_ms") == 0) d->delay_ms = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "error") == 0) d->error = parse_error(value);
    else if (strcmp(key, "fail") == 0) {
        char *code = value + strcspn(value, " \t");
        if (*code) {
            *code++ = '\0';
            code += strspn(code, " \t");
        }
        for (int q = 0; q < Q_COUNT; q++)
            if (strcmp(value, query_names[q]) == 0)
                d->fail[q] = parse_error(code);
    }
}

/* Re-read the state file if it changed. Called with `lock` held. */
static void refresh_state(void)
{
    const char *path = getenv("PDWATCH_NVML_STUB_STATE");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0) {
        memset(&current, 0, sizeof current);
        seen_path[0] = '\0';
        return;
    }
    if (current.loaded && strcmp(path, seen_path) == 0 &&
        st.st_ino == seen_stat.st_ino && st.st_size == seen_stat.st_size &&
        st.st_mtim.tv_sec == seen_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == seen_stat.st_mtim.tv_nsec)
        return;

    FILE *f = fopen(path, "r");
    if (!f) {
        memset(&current, 0, sizeof current);
        seen_path[0] = '\0';
        return;
    }
    static struct state next; /* large; only touched under `lock` */
    memset(&next, 0, sizeof next);
    copy_text(next.driver, "0.0.0-pdwatch-stub");
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = '\0';
        parse_line(&next, line);
    }
    fclose(f);
    next.loaded = 1;
    current = next;
    snprintf(seen_path, sizeof seen_path, "%s", path);
    seen_stat = st;
}

/* ---- library lifetime ---------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    refresh_state();
    nvmlReturn_t ret = NVML_SUCCESS;
    if (!current.loaded)
        ret = NVML_ERROR_DRIVER_NOT_LOADED; /* like a host with the library but no driver */
    else if (current.init_error != NVML_SUCCESS)
        ret = current.init_error;
    else
        init_refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (init_refcount == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else
        init_refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    default: return "Unknown Error";
    }
}

/* ---- system -------------------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (init_refcount == 0) {
        ret = NVML_ERROR_UNINITIALIZED;
    } else {
        refresh_state();
        if (strlen(current.driver) + 1 > length)
            ret = NVML_ERROR_INSUFFICIENT_SIZE;
        else
            snprintf(version, length, "%s", current.driver);
    }
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (init_refcount == 0) {
        ret = NVML_ERROR_UNINITIALIZED;
    } else {
        refresh_state();
        if (current.count_error != NVML_SUCCESS)
            ret = current.count_error;
        else
            *count = current.count;
    }
    pthread_mutex_unlock(&lock);
    return ret;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* ---- devices --------------------------------------------------------------
 * Every device query goes through begin_query(): it checks the library is
 * initialized, refreshes the state, finds the device and applies injected
 * errors. On NVML_SUCCESS the caller holds `lock` and must call end_query().
 */

static nvmlReturn_t begin_query(unsigned int index, enum query q, struct device **out)
{
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (init_refcount == 0) {
        ret = NVML_ERROR_UNINITIALIZED;
    } else {
        refresh_state();
        /* A hung driver call, as on a GPU in trouble: sleep without the lock
         * (the other devices stay answerable), then look at the state again. */
        if (index < current.count && current.devices[index].delay_ms > 0) {
            unsigned int ms = current.devices[index].delay_ms;
            pthread_mutex_unlock(&lock);
            struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&lock);
            refresh_state();
        }
        if (init_refcount == 0)
            ret = NVML_ERROR_UNINITIALIZED;
        else if (index >= current.count)
            /* A handle to a device that left the file: it fell off the bus. */
            ret = q == Q_HANDLE ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_GPU_IS_LOST;
        else if (current.devices[index].error != NVML_SUCCESS)
            ret = current.devices[index].error;
        else if (current.devices[index].fail[q] != NVML_SUCCESS)
            ret = current.devices[index].fail[q];
    }
    if (ret != NVML_SUCCESS) {
        pthread_mutex_unlock(&lock);
        return ret;
    }
    *out = &current.devices[index];
    return NVML_SUCCESS;
}

static void end_query(void) { pthread_mutex_unlock(&lock); }

static nvmlReturn_t handle_index(void *handle, unsigned int *index)
{
    struct handle_slot *slot = handle;
    if (slot < &handle_slots[0] || slot >= &handle_slots[MAX_DEVICES])
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)(slot - handle_slots);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device)
{
    if (!device || index >= MAX_DEVICES)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct device *d;
    nvmlReturn_t ret = begin_query(index, Q_HANDLE, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    *device = &handle_slots[index];
    end_query();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, void **device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* Opens a query on the device behind `handle`, or returns its error. */
#define OPEN_QUERY(handle, q, d)                                   \
    unsigned int index_;                                           \
    struct device *d;                                              \
    nvmlReturn_t ret_ = handle_index((handle), &index_);           \
    if (ret_ == NVML_SUCCESS)                                      \
        ret_ = begin_query(index_, (q), &d);                       \
    if (ret_ != NVML_SUCCESS)                                      \
        return ret_

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(dst, length, "%s", src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length)
{
    OPEN_QUERY(device, Q_UUID, d);
    nvmlReturn_t ret = copy_string(uuid, length, d->uuid);
    end_query();
    return ret;
}

nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length)
{
    OPEN_QUERY(device, Q_NAME, d);
    nvmlReturn_t ret = copy_string(name, length, d->name);
    end_query();
    return ret;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(void *device, nvmlUtilization_t *utilization)
{
    if (!utilization)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_UTILIZATION, d);
    utilization->gpu = d->util_gpu;
    utilization->memory = d->util_memory;
    end_query();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(void *device, unsigned int *power)
{
    if (!power)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_POWER, d);
    *power = d->power_mw;
    end_query();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *device, unsigned int *limit)
{
    if (!limit)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_POWER_LIMIT, d);
    *limit = d->power_limit_mw;
    end_query();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(void *device, unsigned int *limit)
{
    return nvmlDeviceGetEnforcedPowerLimit(device, limit);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory)
{
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_MEMORY, d);
    memory->total = d->memory_total;
    memory->used = d->memory_used;
    memory->free = d->memory_total > d->memory_used ? d->memory_total - d->memory_used : 0;
    end_query();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *memory)
{
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_MEMORY, d);
    memory->total = d->memory_total;
    memory->reserved = 0;
    memory->used = d->memory_used;
    memory->free = d->memory_total > d->memory_used ? d->memory_total - d->memory_used : 0;
    end_query();
    return NVML_SUCCESS;
}

/*
 * NVML's two-call protocol: with too small a buffer (or none), the count is
 * set to the number of processes and INSUFFICIENT_SIZE returned; no process
 * at all is SUCCESS with a count of 0.
 */
static nvmlReturn_t running_processes(void *device, unsigned int *count, void *infos, int v1)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    OPEN_QUERY(device, Q_PROCESSES, d);
    nvmlReturn_t ret = NVML_SUCCESS;
    unsigned int have = d->pid_count;
    if (have == 0) {
        *count = 0;
    } else if (!infos || *count < have) {
        *count = have;
        ret = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < have; i++) {
            /* usedGpuMemory: the device's use shared out; enough for a stub. */
            unsigned long long share = d->memory_used / have;
            if (v1) {
                nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
                p->pid = d->pids[i];
                p->usedGpuMemory = share;
            } else {
                nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
                p->pid = d->pids[i];
                p->usedGpuMemory = share;
                p->gpuInstanceId = 0xFFFFFFFFu;
                p->computeInstanceId = 0xFFFFFFFFu;
            }
        }
        *count = have;
    }
    end_query();
    return ret;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, void *infos)
{
    return running_processes(device, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *device, unsigned int *count, void *infos)
{
    return running_processes(device, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(void *device, unsigned int *count, void *infos)
{
    return running_processes(device, count, infos, 1);
}

/* Lets a caller tell this stub from the real library. */
const char *pdwatch_nvml_stub_version(void) { return "1"; }
