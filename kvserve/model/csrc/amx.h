/*
 * What the products on the AMX tile unit share (csrc/blocks_gemm.c, csrc/int8_gemm.c): the
 * process's permission to use the tile registers and the one tile configuration both load.
 * Include only where __AMX_TILE__ is defined, with _GNU_SOURCE defined first (syscall()).
 */
#ifndef KVSERVE_AMX_H
#define KVSERVE_AMX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KVSERVE_ARCH_REQ_XCOMP_PERM 0x1023
#define KVSERVE_XFEATURE_XTILEDATA 18

/* Whether this process may use the tile registers (the kernel grants them once asked); never
 * with KVSERVE_AMX=0. Each library asks once, under its own pthread_once. */
static inline int amx_permitted(void) {
    const char *asked = getenv("KVSERVE_AMX");
    if (asked && strcmp(asked, "0") == 0) return 0;
    return syscall(SYS_arch_prctl, KVSERVE_ARCH_REQ_XCOMP_PERM, KVSERVE_XFEATURE_XTILEDATA) == 0;
}

/* The tile configuration: palette 1, tiles 0-7 of 16 rows of 64 bytes. A constant, never
 * built on the stack (an on-stack one whose zeroing the compiler dropped faulted ldtilecfg). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
static const amx_config AMX_CONFIG __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

#endif
