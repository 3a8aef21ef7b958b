restart() { pkill -f "jetserve serve --port 50061"; sleep 2; (timeout 600 jetserve serve --port 50061 --openai-port 8010 --metrics-port 9410 > /tmp/serve2.log 2>&1 &); for i in $(seq 1 90); do grep -q "serving demo" /tmp/serve2.log && break; sleep 1; done; sleep 2; }
req() { curl -s -o /dev/null -w "%{time_starttransfer}" http://127.0.0.1:8010/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\": \"demo\", \"messages\": [{\"role\": \"user\", \"content\": \"$1\"}], \"max_tokens\": 16, \"stream\": true}"; }
for round in 1 2 3; do
  for v in before after; do
    cp /tmp/tok_$v.py engine/tokenizer.py
    restart
    echo "$v round $round: first $(req "r${round}${v}a hello") second $(req "r${round}${v}b hello") load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
cp /tmp/tok_after.py engine/tokenizer.py
pkill -f "jetserve serve --port 50061"
