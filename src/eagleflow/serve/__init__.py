"""Rules serve_and_benchmark, benchmark_endpoint, eval_answers, check_acceptance (serve.smk)."""
