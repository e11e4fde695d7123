/*
 * Stress check for the stub, meant to be built with sanitizers
 * (`make nvml-stub-check`): three threads query every device while the main
 * thread replaces the state file 300 times with files of 1 to 70 devices, up
 * to 80 processes each, over-long UUIDs and injected errors. Exits non-zero on
 * a wrong answer; the sanitizers report memory errors and data races.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int nvmlInit_v2(void);
int nvmlShutdown(void);
int nvmlSystemGetDriverVersion(char *, unsigned int);
int nvmlDeviceGetCount_v2(unsigned int *);
int nvmlDeviceGetHandleByIndex_v2(unsigned int, void **);
int nvmlDeviceGetUUID(void *, char *, unsigned int);
int nvmlDeviceGetPowerUsage(void *, unsigned int *);
int nvmlDeviceGetComputeRunningProcesses_v3(void *, unsigned int *, void *);

enum { SUCCESS = 0, UNINITIALIZED = 1, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7, GPU_IS_LOST = 15 };

static void *reader(void *arg)
{
    (void)arg;
    for (int k = 0; k < 2000; k++) {
        unsigned int n;
        if (nvmlDeviceGetCount_v2(&n) != SUCCESS)
            continue;
        for (unsigned int i = 0; i < n; i++) {
            void *h;
            if (nvmlDeviceGetHandleByIndex_v2(i, &h) != SUCCESS)
                continue; /* the file shrank under us */
            char uuid[96];
            unsigned int mw, count = 0;
            int r = nvmlDeviceGetUUID(h, uuid, sizeof uuid);
            if (r == SUCCESS && strncmp(uuid, "GPU-", 4) != 0) {
                fprintf(stderr, "bad uuid %s\n", uuid);
                exit(1);
            }
            r = nvmlDeviceGetPowerUsage(h, &mw);
            if (r != SUCCESS && r != NOT_SUPPORTED && r != GPU_IS_LOST) {
                fprintf(stderr, "power: %d\n", r);
                exit(1);
            }
            if (nvmlDeviceGetComputeRunningProcesses_v3(h, &count, NULL) == INSUFFICIENT_SIZE) {
                static __thread unsigned char infos[24 * 200];
                count = 200;
                nvmlDeviceGetComputeRunningProcesses_v3(h, &count, infos);
            }
        }
    }
    return NULL;
}

static void write_state(const char *path, int k)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        perror(tmp);
        exit(1);
    }
    fprintf(f, "driver stress\n");
    for (int i = 0; i < 1 + k % 70; i++) {
        fprintf(f, "device\nuuid GPU-%d-%0200d\nname stress %d\npower_mw %d\npids", i, 0, i, k);
        for (int j = 0; j < k % 80; j++)
            fprintf(f, " %d", 1000 + j);
        fprintf(f, "\n%s\n", k % 3 ? "" : "fail power NOT_SUPPORTED");
    }
    fclose(f);
    if (rename(tmp, path) != 0) {
        perror("rename");
        exit(1);
    }
}

int main(void)
{
    const char *path = getenv("PDWATCH_NVML_STUB_STATE");
    if (!path) {
        fprintf(stderr, "set PDWATCH_NVML_STUB_STATE\n");
        return 2;
    }
    write_state(path, 0);
    if (nvmlInit_v2() != SUCCESS) {
        fprintf(stderr, "init failed\n");
        return 1;
    }
    char small[4];
    if (nvmlSystemGetDriverVersion(small, sizeof small) != INSUFFICIENT_SIZE) {
        fprintf(stderr, "driver version overflowed a small buffer\n");
        return 1;
    }
    pthread_t threads[3];
    for (int i = 0; i < 3; i++)
        pthread_create(&threads[i], NULL, reader, NULL);
    for (int k = 1; k < 300; k++)
        write_state(path, k);
    for (int i = 0; i < 3; i++)
        pthread_join(threads[i], NULL);
    int first = nvmlShutdown();
    int second = nvmlShutdown();
    if (first != SUCCESS || second != UNINITIALIZED) {
        fprintf(stderr, "shutdown: %d then %d\n", first, second);
        return 1;
    }
    puts("nvml stub stress: ok");
    return 0;
}
