"""What the agent and the fleet controller agree on over MQTT: topics, messages, connection options.

Both sides import this package and neither imports the other. Python 3.8 (the agent runs there).
"""
