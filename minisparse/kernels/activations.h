/* The MLP activations by their abi.h code, one float at a time: SiLU x sigmoid(x), ReLU
   max(x, 0), and the exact GELU x Phi(x) = x (1 + erf(x / sqrt 2)) / 2 (torch's default). */
#include <math.h>

static inline float activate(int act, float v) {
    if (act == ACT_SILU) return v / (1.0f + expf(-v));
    if (act == ACT_RELU) return v > 0.0f ? v : 0.0f;
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}
