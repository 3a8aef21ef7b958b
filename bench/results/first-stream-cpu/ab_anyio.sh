# before/after: server/app.py without and with the warm-up, as /tmp/app_before.py and /tmp/app_after.py
cd "$(git rev-parse --show-toplevel)"
restart() { pkill -f "jetserve serve --port 50061"; sleep 2; (timeout 600 jetserve serve --port 50061 --openai-port 8010 --metrics-port 9410 > /tmp/serve2.log 2>&1 &); for i in $(seq 1 90); do grep -q "serving demo" /tmp/serve2.log && break; sleep 1; done; sleep 2; }
chat() { curl -s -o /dev/null -w "%{time_starttransfer}" http://127.0.0.1:8010/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\": \"demo\", \"messages\": [{\"role\": \"user\", \"content\": \"$1\"}], \"max_tokens\": 16, \"stream\": true}"; }
comp() { curl -s -o /dev/null -w "%{time_starttransfer}" http://127.0.0.1:8010/v1/completions -H "Content-Type: application/json" -d "{\"model\": \"demo\", \"prompt\": \"$1\", \"max_tokens\": 32, \"temperature\": 0, \"stream\": true}"; }
for round in 1 2 3; do
  for v in before after; do
    cp /tmp/app_$v.py server/app.py
    restart
    echo "$v round $round: chat first $(chat "r${round}${v}a hello") second $(chat "r${round}${v}b hello") | load $(cut -d' ' -f1 /proc/loadavg)"
    restart
    echo "$v round $round: completion first $(comp "r${round}${v}a The robot") second $(comp "r${round}${v}b The robot") | load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
cp /tmp/app_after.py server/app.py
pkill -f "jetserve serve --port 50061"
