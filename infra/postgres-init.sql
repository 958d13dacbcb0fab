-- MLflow's database beside Prefect's (created on the first start of the postgres volume).
CREATE DATABASE mlflow OWNER moelab;
