/* The structs of kvtier.h as this compiler laid them out: their sizes and every field's offset,
 * so the Python side (kvtier/kernels/abi.py) checks its ctypes mirrors against the library it
 * loaded, not against a copy of the header (docs/architecture.md §Kernels). A field missing
 * from the tables below is caught by the test that parses kvtier.h (tests/kernels/test_abi.py);
 * a field named here but not in the struct does not compile. */
#include <stddef.h>
#include <string.h>

#include "kvtier.h"

typedef struct {
    const char *field;
    int64_t offset;
} Field;

#define F(S, name) {#name, (int64_t)offsetof(S, name)}

static const Field layer_fields[] = {
    F(Layer, input_norm), F(Layer, post_attn_norm), F(Layer, pre_ff_norm),
    F(Layer, post_ff_norm), F(Layer, q_norm), F(Layer, k_norm), F(Layer, qkv), F(Layer, o),
    F(Layer, gate_up), F(Layer, down), F(Layer, qkv_bias), F(Layer, o_bias),
    F(Layer, gate_up_bias), F(Layer, down_bias), F(Layer, qkv_scale), F(Layer, o_scale),
    F(Layer, gate_up_scale), F(Layer, down_scale), F(Layer, hidden),
    F(Layer, heads), F(Layer, kv_heads), F(Layer, head_dim), F(Layer, inter), F(Layer, eps),
    F(Layer, scale), F(Layer, softcap), F(Layer, k_scale), F(Layer, v_scale), F(Layer, gemma),
    F(Layer, qk_gemma), F(Layer, act), F(Layer, kv_dtype), F(Layer, w8a8),
};

static const Field step_fields[] = {
    F(Step, tables), F(Step, table_stride), F(Step, seq_token), F(Step, seq_qlen),
    F(Step, seq_row), F(Step, lo), F(Step, hi), F(Step, num_seqs), F(Step, write_rows),
    F(Step, write_tokens), F(Step, num_written), F(Step, block_size),
};

#undef F

static const Field *fields_of(const char *name, int64_t *n, int64_t *size) {
    if (strcmp(name, "Layer") == 0) {
        *n = sizeof layer_fields / sizeof *layer_fields, *size = sizeof(Layer);
        return layer_fields;
    }
    if (strcmp(name, "Step") == 0) {
        *n = sizeof step_fields / sizeof *step_fields, *size = sizeof(Step);
        return step_fields;
    }
    return NULL;
}

int64_t kvtier_abi_sizeof(const char *name) {
    int64_t n, size;
    return fields_of(name, &n, &size) ? size : -1;
}

int64_t kvtier_abi_offsetof(const char *name, const char *field) {
    int64_t n, size;
    const Field *fields = fields_of(name, &n, &size);
    for (int64_t i = 0; fields && i < n; i++)
        if (strcmp(fields[i].field, field) == 0) return fields[i].offset;
    return -1;
}

int64_t kvtier_abi_fields(const char *name) {
    int64_t n, size;
    return fields_of(name, &n, &size) ? n : -1;
}
