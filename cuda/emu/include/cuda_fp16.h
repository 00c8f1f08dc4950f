#pragma once
// Emulation stand-in for the CUDA header: the types live in cuda_emu_half.h (part of cuda_emu.h).
#include "../cuda_emu.h"
