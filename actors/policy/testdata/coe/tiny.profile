# A tiny two-executor box for golden scenarios: every 100-byte expert loads in 1000 us from SSD.
format troupe-coe-profile 1
hardware_fingerprint golden-test-box
executor gpu0
kind gpu
memory_bytes 300
expert_memory_bytes 200
max_batch 2
bandwidth host 1000000
bandwidth ssd 100000
size_class 1000 1:100 2:150
executor cpu0
kind cpu
memory_bytes 300
expert_memory_bytes 100
max_batch 2
bandwidth host 1000000
bandwidth ssd 100000
size_class 1000 1:1000 2:2000
