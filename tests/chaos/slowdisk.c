/*
 * A slow disk for one process, loaded with LD_PRELOAD: fsync and fdatasync wait the number of
 * milliseconds written in the file FENCEGATE_SLOW_DISK names (read at every call; no file, an
 * empty file or 0: no wait) before they sync. The chaos run's slow-disk fault uses it on the
 * fence whose store is a redb file: every raise is committed with an fdatasync before the write
 * it admits is forwarded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long delay_ms(void) {
    const char *path = getenv("FENCEGATE_SLOW_DISK");
    if (path == NULL) {
        return 0;
    }
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        return 0;
    }
    long ms = 0;
    if (fscanf(file, "%ld", &ms) != 1) {
        ms = 0;
    }
    fclose(file);
    return ms;
}

static void stall(void) {
    long ms = delay_ms();
    if (ms > 0) {
        struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
        while (nanosleep(&t, &t) != 0) {
        }
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    }
    stall();
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    }
    stall();
    return real(fd);
}
