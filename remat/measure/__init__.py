"""What both executors measure with: device profiles and op costs, kernel scratch, CUDA's
autocast lists on a CPU trace, and the memory meters that check every prediction."""
