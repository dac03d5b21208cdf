"""SUN / QSUN: the accuracy table on a real model, shared vs isolated decode pools, the int4 decoder's speed."""
