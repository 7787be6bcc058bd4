"""eagle3-train: EAGLE-3 draft training pipeline for vLLM-served reasoning targets."""
