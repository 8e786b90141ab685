/* The library's side of the ABI check: the version and struct sizes it was compiled with, which the
 * loader (kernels/cpu/abi.py) compares with what it parsed from ds_abi.h. */
#include <string.h>
#include "ds_abi.h"

int ds_abi_version(void) { return DS_ABI_VERSION; }

size_t ds_abi_sizeof(const char *name) {
    static const struct { const char *name; size_t size; } structs[] = {
        {"ds_moe_block_t", sizeof(ds_moe_block_t)},
        {"ds_kda_block_t", sizeof(ds_kda_block_t)},
        {"ds_mla_block_t", sizeof(ds_mla_block_t)},
        {"ds_stack_layer_t", sizeof(ds_stack_layer_t)},
        {"ds_stack_t", sizeof(ds_stack_t)},
    };
    for (size_t i = 0; i < sizeof(structs) / sizeof(structs[0]); ++i)
        if (strcmp(name, structs[i].name) == 0) return structs[i].size;
    return 0;
}
