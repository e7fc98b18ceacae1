"""Native CPU kernels: weight-only int4/int8 linear layers, exact per row (`native`, `packing`, `grid`, `qlinear.cpp`)."""
