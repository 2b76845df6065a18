"""The enforcer: Salus lanes and admission, placement policies, the planner and its store side, migration and the
simulator."""
