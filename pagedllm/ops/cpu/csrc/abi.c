/* What native.py asks the library before using it (see pd_kernels.h). */
#include "pd_kernels.h"

int pd_abi_version(void) { return PD_ABI_VERSION; }
int pd_has_avx2(void) { return PD_AVX2; }
