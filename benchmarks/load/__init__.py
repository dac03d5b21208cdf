"""N sessions on one draft service and N requests on one SUN decoder: fairness, memory, refusals."""
