// The bindings of bindings.cpp as the module spd_kernels._spd_simt: the kernels compiled for the
// host emulation (simt_host.h). A file of its own so its object never stands in for _spd_cuda's.
#define SPD_MODULE _spd_simt
#define SPD_SIMT_HOST 1
#include "bindings.cpp"
