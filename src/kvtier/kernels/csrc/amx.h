/* What the kernels on AMX tiles share (linear_amx.c's linears, attention_amx.c's decode
 * attention): the OS's grant of the tile state and the tile configuration. Included by the
 * files compiled with AMX (KVTIER_AMX, internal.h). */
#ifndef KVTIER_AMX_H
#define KVTIER_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux grants a process the AMX tile state on request (once for all its threads). */
static inline int amx_granted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* This thread's tiles 0-7: rows[t] rows of 64 bytes each (0: tile t unused) */
static inline void amx_configure(const uint8_t rows[8]) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    /* GCC 12 does not see ldtilecfg read the struct and drops its stores as dead where this is
     * inlined into a short function: the barrier makes them happen first */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

#endif
