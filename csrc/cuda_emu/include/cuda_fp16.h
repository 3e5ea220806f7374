// Stands in for the CUDA header of this name in the emulated build (see ../cuda_emu.h).
#pragma once
#include "../cuda_emu.h"
