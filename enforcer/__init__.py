"""The enforcer: Salus lanes and admission, placement policies, the planner, migration and the simulator."""
